"""The rollouts generated ahead of the trained step, kept with a checkpoint so that a resumed
run trains on the batches an uninterrupted one would, and the weights a batch the stop cut
short was due to be generated with (:class:`HeldWeights`): safetensors files per rank (no
pickle), read back as untrusted (every shape, dtype and count checked; errors name the file).
"""

from __future__ import annotations

import json
from pathlib import Path
from dataclasses import dataclass
from typing import Dict, Iterable, Iterator, Mapping, Optional, Tuple

import torch

from nemo_d3s.backends.base import Rollouts, TokenBatch
from nemo_d3s.errors import RunError
from nemo_d3s.core.routing import NO_EXPERT

__all__ = [
    "HeldWeights",
    "OtherLayout",
    "held_weights_fit",
    "load_held_weights",
    "load_rollouts",
    "optional_held_weights",
    "rollouts_file",
    "save_held_weights",
    "save_rollouts",
    "weights_file",
]

FORMAT = "nemo_d3s.rollouts.v1"
WEIGHTS_FORMAT = "nemo_d3s.engine_weights.v1"


@dataclass
class HeldWeights:
    """Weights ``version`` as an engine held them (HF names): a stand-in for the policy in
    ``RolloutEngine.sync_weights``, which reads ``refit_weights`` and ``weights_version``."""

    tensors: Dict[str, torch.Tensor]
    version: int

    @property
    def weights_version(self) -> int:
        return self.version

    def refit_weights(self) -> Iterator[Tuple[str, torch.Tensor]]:
        return iter(self.tensors.items())


def rollouts_file(rank: int) -> str:
    """The file name of global rank ``rank``'s rollouts in a checkpoint folder."""
    return f"rollouts_rank{int(rank)}.safetensors"


def save_rollouts(
    path: Path, batches: Mapping[int, Tuple[Rollouts, int]], prompts: Tuple[int, int]
) -> None:
    """``batches``: step -> (this rank's rollouts, the weights version they were generated
    with); ``prompts``: this rank's [lo, hi) slice of every step's prompts."""
    from safetensors.torch import save_file

    tensors: Dict[str, torch.Tensor] = {}
    index = []
    for step, (ro, version) in sorted(batches.items()):
        texts = [t.encode("utf-8") for t in ro.response_texts]
        joined = b"".join(texts)
        parts = {
            "input_ids": ro.batch.input_ids.long(),
            "attention_mask": ro.batch.attention_mask.bool(),
            "response_mask": ro.batch.response_mask.bool(),
            "prompt_index": ro.prompt_index.long(),
            "finished": ro.finished.bool(),
            "text_bytes": torch.frombuffer(bytearray(joined), dtype=torch.uint8)
            if joined
            else torch.zeros(0, dtype=torch.uint8),
            "text_lengths": torch.tensor([len(b) for b in texts], dtype=torch.long),
        }
        if ro.sampling_logprobs is not None:
            parts["sampling_logprobs"] = ro.sampling_logprobs.float()
        if ro.routed_experts is not None:
            parts["routed_experts"] = ro.routed_experts.to(torch.int16)
        for name, t in parts.items():
            tensors[f"{int(step)}.{name}"] = t.contiguous().cpu()
        index.append({"step": int(step), "version": int(version)})
    meta = {"format": FORMAT, "batches": json.dumps(index), "prompts": json.dumps(list(prompts))}
    save_file(tensors, str(path), metadata=meta)


class OtherLayout(RunError):
    """A rollouts file written by a rank that held another slice of the prompts (the run
    resumed at another data-parallel layout)."""


def _check(ok: bool, path: Path, why: str, error: type = RunError) -> None:
    # (its checkpoint's checksums cover it: deleting it would make the checkpoint unusable)
    if not ok:
        raise error(
            f"{str(path)!r}: {why}; move its checkpoint folder out of checkpoints/ to resume "
            "from the one before"
        )


def _read(path: Path, fmt: str, what: str) -> Tuple[Dict[str, str], Dict[str, torch.Tensor]]:
    """(metadata, tensors) of safetensors file ``path`` written in format ``fmt``."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # a truncated or foreign file
        raise RunError(f"{str(path)!r}: not {what} ({e})") from None
    _check(meta.get("format") == fmt, path, f"format {meta.get('format')!r}, not {fmt}")
    return meta, tensors


def _batch(tensors: Dict[str, torch.Tensor], step: int, path: Path) -> Rollouts:
    """Step ``step``'s rollouts from the file's tensors, every shape and dtype checked."""

    def get(name: str, dtype: torch.dtype, dim: int, optional: bool = False):
        t = tensors.get(f"{step}.{name}")
        if t is None and optional:
            return None
        _check(t is not None, path, f"step {step} has no tensor {name!r}")
        _check(t.dtype == dtype and t.dim() == dim, path, f"{step}.{name} is not {dtype} {dim}-D")
        return t

    ids = get("input_ids", torch.long, 2)
    shape = tuple(ids.shape)
    masks = [get(n, torch.bool, 2) for n in ("attention_mask", "response_mask")]
    sampling = get("sampling_logprobs", torch.float32, 2, optional=True)
    routed = get("routed_experts", torch.int16, 4, optional=True)
    for t in [*masks] + [x for x in (sampling, routed) if x is not None]:
        _check(tuple(t.shape[:2]) == shape, path, f"step {step}: [B, S] tensors differ in shape")
    if routed is not None:
        _check(bool((routed >= NO_EXPERT).all()), path, f"step {step}: routed_experts < -1")
    index, finished = get("prompt_index", torch.long, 1), get("finished", torch.bool, 1)
    raw, lengths = get("text_bytes", torch.uint8, 1), get("text_lengths", torch.long, 1)
    B = shape[0]
    _check(index.numel() == B and finished.numel() == B and lengths.numel() == B, path, "rows")
    _check(bool((lengths >= 0).all()) and int(lengths.sum()) == raw.numel(), path, "text sizes")
    data = bytes(raw.tolist())
    texts, at = [], 0
    for n in lengths.tolist():
        try:
            texts.append(data[at : at + n].decode("utf-8"))
        except UnicodeDecodeError:
            _check(False, path, f"step {step}: a response text is not UTF-8")
        at += n
    batch = TokenBatch(ids, masks[0], masks[1])
    return Rollouts(
        batch, index, texts, finished, {}, sampling_logprobs=sampling, routed_experts=routed
    )


def load_rollouts(path: Path, prompts: Tuple[int, int]) -> Dict[int, Tuple[Rollouts, int]]:
    """What :func:`save_rollouts` wrote: step -> (rollouts, version). RunError naming the file
    when it is not such a file or was written for another slice of the prompts."""
    meta, tensors = _read(path, FORMAT, "a rollouts file")
    try:
        index = json.loads(meta.get("batches", ""))
        held = json.loads(meta.get("prompts", ""))
    except ValueError:
        _check(False, path, "unreadable metadata")
    _check(
        held == list(prompts),
        path,
        f"written for prompts {held}, this rank holds {prompts}",
        OtherLayout,
    )
    _check(isinstance(index, list), path, "the batch index is not a list")
    out: Dict[int, Tuple[Rollouts, int]] = {}
    for entry in index:
        ok = isinstance(entry, dict) and all(type(entry.get(k)) is int for k in ("step", "version"))
        _check(ok, path, f"a bad batch entry {entry!r}")
        out[entry["step"]] = (_batch(tensors, entry["step"], path), entry["version"])
    return out


def weights_file(rank: int) -> str:
    """The file name of global rank ``rank``'s engine weights in a checkpoint folder."""
    return f"engine_weights_rank{int(rank)}.safetensors"


def save_held_weights(
    path: Path, weights: Iterable[Tuple[str, torch.Tensor]], version: int
) -> None:
    """The (HF name, tensor) pairs an engine holds (none on a rank whose group's engine
    lives elsewhere), with the weights version they are."""
    from safetensors.torch import save_file

    tensors = {str(n): t.detach().contiguous().cpu() for n, t in weights}
    meta = {"format": WEIGHTS_FORMAT, "version": str(int(version))}
    save_file(tensors, str(path), metadata=meta)


def load_held_weights(path: Path) -> HeldWeights:
    """What :func:`save_held_weights` wrote; RunError naming the file otherwise (names and
    shapes are checked by the engine that loads them)."""
    meta, tensors = _read(path, WEIGHTS_FORMAT, "an engine weights file")
    version = meta.get("version", "")
    _check(version.isdigit(), path, f"a bad version {version!r}")
    _check(all(t.is_floating_point() for t in tensors.values()), path, "a non-float weight")
    return HeldWeights(tensors, int(version))


def optional_held_weights(path: Path) -> Optional[HeldWeights]:
    """:func:`load_held_weights` of ``path``, None when there is no such file."""
    return load_held_weights(path) if path.is_file() else None


def held_weights_fit(
    held: HeldWeights, own: Optional[Iterable[Tuple[str, torch.Tensor]]]
) -> Optional[str]:
    """Why the weights a checkpoint kept for this rank do not fit the engine here (None: they
    fit). ``own``: the engine's ``held_weights()`` now. A rank whose engine lived elsewhere
    wrote an empty file; after a resume at another TP / PP or engine count
    (``parallel.engine_blocks``) an engine rank could read such a file, or another copy's, and
    refit from nothing. ``own`` None (vLLM: cannot read its weights back) is compared by
    emptiness only; the engine checks the names of a refit."""
    if own is None:
        return None if held.tensors else "an empty file for this rank's engine"
    shapes = {str(n): tuple(t.shape) for n, t in own}
    if shapes == {n: tuple(t.shape) for n, t in held.tensors.items()}:
        return None
    if not shapes or not held.tensors:
        here = "an engine" if shapes else "no engine"
        return f"{len(held.tensors)} weights where this rank holds {here}"
    return f"{len(held.tensors)} weights that are not the {len(shapes)} of this rank's engine"
