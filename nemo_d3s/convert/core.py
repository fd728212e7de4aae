"""Checkpoint conversion between Hugging Face folders and the Megatron backend's sharded
checkpoints, on the backend's one weight table (``backends.megatron.weights``).

- :func:`hf_to_megatron`: an HF folder -> ``OUT/config.json`` + tokenizer +
  ``OUT/megatron/{layout.json, tpXX_ppYY.safetensors}`` at any TP x PP (no optimizer
  state): what ``MegatronBackend(model=OUT)`` starts from. One process writes every shard.
- :func:`megatron_to_hf`: a training checkpoint (``output_dir/checkpoints/step_XXXXXX``, any
  saved layout) or a converted one -> an HF folder (safetensors shards + index, config.json
  with its dtype, generation config, tokenizer) that transformers loads.
- :func:`verify`: logits of a few fixed prompts, transformers on the HF folder vs the
  checkpoint converted in memory; a one-line verdict.

Memory: tensors stream one local parameter group at a time (the saved TP shards of one
Megatron parameter and the HF tensors they make, e.g. q/k/v of one layer), straight into
safetensors files whose headers are planned up front from the table's shapes
(:class:`StreamingSafetensors`), so peak memory is near the largest group (the embedding),
not the model.

Safety: every file read is untrusted input (safetensors and JSON only, never pickle); a
folder that is not a checkpoint, an architecture the table does not know, a tensor whose
shape disagrees with config.json and missing tokenizer files are each a
:class:`~nemo_d3s.config.ConfigError` naming the file or tensor, raised before anything is
written. Output goes to a temporary sibling folder renamed into place at the end, so an
error or an interrupt leaves no output folder behind; files follow the process umask.
"""

from __future__ import annotations

import gc
import json
import math
import os
import shutil
import struct
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from nemo_d3s.backends.megatron import checkpoint as ckpt
from nemo_d3s.backends.megatron.hf_config import ModelSpec, check_layout, padded_vocab_size, read_hf_config
from nemo_d3s.backends.megatron.weights import (
    Layout,
    SafetensorsReader,
    hf_names,
    hf_shape,
    local_names,
    local_parts,
    local_shape,
    read_local,
)
from nemo_d3s.config import ConfigError

__all__ = [
    "DTYPES",
    "StreamingSafetensors",
    "CheckpointSource",
    "VerifyResult",
    "hf_to_megatron",
    "megatron_to_hf",
    "open_checkpoint",
    "verify",
]

DTYPES: Dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_ST_NAME = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
_ST_DTYPE = {v: k for k, v in _ST_NAME.items()}

# Tokenizer files copied with a model (whichever exist); at least one of _TOKENIZER_MODEL
# must, or transformers' AutoTokenizer has nothing to load.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                    "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt", "chat_template.jinja",
                    "chat_template.json")
_TOKENIZER_MODEL = ("tokenizer.json", "tokenizer.model", "vocab.json")
GENERATION_CONFIG = "generation_config.json"
DEFAULT_SHARD_BYTES = 5 * 2**30

# Prompts of verify(): short, different kinds of text.
VERIFY_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n",
    "Question: what is 12 + 30? Answer:",
    "Once upon a time, in a small village,",
)


# ============================================================================ safetensors out
def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


class StreamingSafetensors:
    """One safetensors file written tensor by tensor: the header is planned from the
    (name, shape, dtype) entries before any tensor exists, and each tensor's bytes go to its
    planned offset when it arrives, so the writer never holds more than the tensor it is
    given. The file is what ``safetensors.torch.save_file`` writes (8-byte header length,
    JSON header padded to 8 bytes, contiguous data; larger element types first so every
    tensor is aligned) and loads with ``safe_open``/transformers. Used as a context manager:
    leaving it normally checks that every planned tensor arrived (else RuntimeError); leaving
    it with an error just closes the file, which the caller discards."""

    def __init__(self, path: Path, entries: Sequence[Tuple[str, Tuple[int, ...], torch.dtype]],
                 metadata: Optional[Dict[str, str]] = None) -> None:
        self.path = Path(path)
        header: Dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
        order = sorted(entries, key=lambda e: -torch.empty((), dtype=e[2]).element_size())
        self._slots: Dict[str, Tuple[int, Tuple[int, ...], torch.dtype]] = {}
        off = 0
        for name, shape, dtype in order:
            if name in self._slots:
                raise ValueError(f"{name!r} planned twice in {self.path.name}")
            n = _nbytes(shape, dtype)
            header[name] = {"dtype": _ST_NAME[dtype], "shape": list(shape), "data_offsets": [off, off + n]}
            self._slots[name] = (off, tuple(shape), dtype)
            off += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self._base, self.nbytes = 8 + len(raw), off
        self._pending = set(self._slots)
        self._f = open(self.path, "wb")
        self._f.write(struct.pack("<Q", len(raw)) + raw)

    def write(self, name: str, t: torch.Tensor) -> None:
        off, shape, dtype = self._slots[name]
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise ValueError(f"{name!r}: got {tuple(t.shape)} {t.dtype}, planned {shape} {dtype}")
        self._f.seek(self._base + off)
        if t.numel():
            self._f.write(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
        self._pending.discard(name)

    def __enter__(self) -> "StreamingSafetensors":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:  # the caller's error stands; the file is discarded with the temporary folder
            self._f.close()

    def close(self) -> None:
        self._f.seek(0, os.SEEK_END)
        end = self._f.tell()
        self._f.close()
        if self._pending:
            raise RuntimeError(f"{self.path.name}: tensors never written: {sorted(self._pending)[:3]}")
        if end != self._base + self.nbytes:
            raise RuntimeError(f"{self.path.name}: {end} bytes written, {self._base + self.nbytes} planned")


# ============================================================================ output folders
@contextmanager
def _staged_output(out: str | os.PathLike, *, overwrite: bool, sources: Sequence[Path]) -> Iterator[Path]:
    """A temporary sibling of ``out`` to write into, renamed to ``out`` when the block
    succeeds and removed when it raises (an error, an interrupt): no half-written folder is
    ever found at ``out``. A non-empty ``out`` is refused unless ``overwrite``; so is an
    ``out`` that is a source folder or holds one (the rename would delete it)."""
    dest = Path(out).expanduser().absolute()
    for src in sources:
        s = Path(src).resolve()
        d = dest.resolve()
        if d == s or d in s.parents:
            raise ConfigError(f"--out {str(dest)!r} is (or holds) the source {str(src)!r}; choose another folder")
    if dest.exists() and not dest.is_dir():
        raise ConfigError(f"--out {str(dest)!r} exists and is not a folder")
    if dest.is_dir() and any(dest.iterdir()) and not overwrite:
        raise ConfigError(f"--out {str(dest)!r} is not empty; pass --overwrite to replace it")
    created: List[Path] = []  # parent folders made here, removed again on failure
    p = dest.parent
    while not p.exists():
        created.append(p)
        p = p.parent
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    done = False
    try:
        yield tmp
        from nemo_d3s.files import apply_umask

        apply_umask(tmp)
        old = dest.parent / f".{dest.name}.old-{uuid.uuid4().hex[:8]}"
        if dest.exists():
            os.rename(dest, old)
        os.rename(tmp, dest)
        done = True
        shutil.rmtree(old, ignore_errors=True)
    finally:
        if not done:
            shutil.rmtree(tmp, ignore_errors=True)
            for c in created:  # innermost first
                try:
                    c.rmdir()
                except OSError:
                    break


def _progress(total: int, desc: str, enabled: bool):
    from tqdm.auto import tqdm

    # disable=None: shown on a terminal only (no progress lines in logs and test output)
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                disable=None if enabled else True, leave=False)


# ============================================================================ side files
def _tokenizer_files(folder: Path, *, role: str) -> List[Path]:
    """The tokenizer files of ``folder``; ConfigError naming what is missing."""
    have = [folder / n for n in _TOKENIZER_FILES if (folder / n).is_file()]
    names = {p.name for p in have}
    missing = [n for n in ("tokenizer_config.json",) if n not in names]
    if not any(n in names for n in _TOKENIZER_MODEL):
        missing.append(" or ".join(_TOKENIZER_MODEL))
    if missing:
        raise ConfigError(f"{str(folder)!r} ({role}) has no tokenizer: missing {', '.join(missing)}; the converted "
                          "model needs its tokenizer files (give the model folder the checkpoint was trained from)")
    for p in have:
        if p.suffix == ".json":
            _read_json(p)
    return have


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{str(path)!r} is not valid JSON: {e}") from None


def _copy_side_files(src: Path, dst: Path, tokenizer: Sequence[Path], *, dtype: Optional[torch.dtype]) -> None:
    """config.json (its dtype set to ``dtype`` when that differs; else copied byte for byte),
    generation_config.json when present, and the tokenizer files."""
    cfg_path = src / "config.json"
    cfg = read_hf_config(src)
    key = "torch_dtype" if "torch_dtype" in cfg else "dtype"
    want = None if dtype is None else str(dtype).replace("torch.", "")
    if want is None or cfg.get(key) == want:
        shutil.copyfile(cfg_path, dst / "config.json")
    else:
        cfg[key] = want
        (dst / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    gen = src / GENERATION_CONFIG
    if gen.is_file():
        if not isinstance(_read_json(gen), dict):
            raise ConfigError(f"{str(gen)!r} must hold a JSON object")
        shutil.copyfile(gen, dst / GENERATION_CONFIG)
    for p in tokenizer:
        shutil.copyfile(p, dst / p.name)


# ============================================================================ HF -> Megatron
def _source_dtype(reader: SafetensorsReader, name: str, spec: ModelSpec, layout: Layout) -> torch.dtype:
    """The stored dtype of the first HF tensor local parameter ``name`` is made of."""
    from safetensors import safe_open

    for part in local_parts(name, spec, layout)[1]:
        if part.hf_name is not None:
            with safe_open(str(reader.files[part.hf_name]), framework="pt") as f:
                got = f.get_slice(part.hf_name).get_dtype()
            if got not in _ST_DTYPE:
                raise ConfigError(f"{str(reader.files[part.hf_name])!r}: tensor {part.hf_name!r} is {got}; "
                                  "expected F32, BF16 or F16")
            return _ST_DTYPE[got]
    return torch.float32


def _resolve_hf(hf: str | os.PathLike) -> Path:
    from nemo_d3s.backends.hf.loading import resolve_model_path

    try:
        return Path(resolve_model_path(str(hf)))
    except FileNotFoundError as e:
        raise ConfigError(str(e)) from None


def hf_to_megatron(hf: str | os.PathLike, out: str | os.PathLike, *, tp: int = 1, pp: int = 1,
                   dtype: Optional[str] = None, make_vocab_size_divisible_by: int = 128, overwrite: bool = False,
                   progress: bool = True) -> Path:
    """Convert the HF folder ``hf`` into a Megatron checkpoint folder ``out`` with TP x PP
    shard files (see the module docstring). ``dtype`` None keeps every tensor's stored
    dtype. Returns ``out``."""
    src = _resolve_hf(hf)
    spec = ModelSpec.from_folder(src)
    for name, v in (("tp", tp), ("pp", pp), ("make_vocab_size_divisible_by", make_vocab_size_divisible_by)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"--{name.replace('_', '-')}={v!r} must be an integer >= 1")
    check_layout(spec, tp=tp, pp=pp, world=tp * pp)
    want = _dtype(dtype)
    reader = SafetensorsReader(src, spec)
    reader.check()
    tokenizer = _tokenizer_files(src, role="--hf")
    layout = Layout(tp=tp, pp=pp, padded_vocab=padded_vocab_size(spec.vocab_size, tp, make_vocab_size_divisible_by))
    plan = []  # (layout of the file, [(local name, shape, dtype)])
    for p in range(pp):
        for t in range(tp):
            lay = layout.at(t, p)
            plan.append((lay, [(n, local_shape(n, spec, lay), want or _source_dtype(reader, n, spec, lay))
                               for n in local_names(spec, lay)]))
    total = sum(_nbytes(s, d) for _, entries in plan for _, s, d in entries)
    try:
        with _staged_output(out, overwrite=overwrite, sources=[src]) as tmp:
            root = tmp / ckpt.SUBDIR
            root.mkdir()
            with _progress(total, f"hf-to-megatron TP{tp} x PP{pp}", progress) as bar:
                for lay, entries in plan:
                    with StreamingSafetensors(root / ckpt.shard_file(lay.tp_rank, lay.pp_rank), entries,
                                              {"format": "pt", "written_by": "nemo-d3s-convert hf-to-megatron"}) as w:
                        for name, _, dt in entries:
                            t = read_local(name, spec, lay, reader, dt)
                            w.write(name, t)
                            bar.update(_nbytes(t.shape, dt))
                            del t
            ckpt.write_layout(root, spec, layout)
            _copy_side_files(src, tmp, tokenizer, dtype=want)
    finally:
        reader.close()
    return Path(out)


# ============================================================================ Megatron -> HF
@dataclass
class CheckpointSource:
    """A Megatron checkpoint opened for reading: its ``megatron/`` folder, the config folder
    (config.json + tokenizer), the model, the saved layout and the stored dtype."""

    folder: Path
    root: Path
    config_dir: Path
    spec: ModelSpec
    saved: Layout
    dtype: Optional[torch.dtype]  # None: the parameters are stored in several dtypes

    def reader(self) -> ckpt.ShardedReader:
        return ckpt.ShardedReader(self.root, self.spec, self.saved)

    def iter_hf(self, dtype: Optional[torch.dtype] = None) -> Iterator[Tuple[str, torch.Tensor]]:
        """(HF name, full tensor) in transformers' order, one parameter group in memory."""
        reader = self.reader()
        for name in hf_names(self.spec):
            shape = hf_shape(name, self.spec)
            t = reader.rows(name, 0, 0, shape[0])
            yield name, (t if dtype is None else t.to(dtype))


def _find_root(path: Path) -> Tuple[Path, Path]:
    """(checkpoint folder, its megatron/ folder) for a checkpoint folder or its megatron/."""
    if (path / ckpt.SUBDIR / "layout.json").is_file():
        return path, path / ckpt.SUBDIR
    if path.name == ckpt.SUBDIR and (path / "layout.json").is_file():
        return path.parent, path
    if not path.exists():
        raise ConfigError(f"--ckpt {str(path)!r}: no such folder")
    steps = sorted(p.name for p in path.iterdir() if p.is_dir() and p.name.startswith("step_")) if path.is_dir() else []
    hint = f" It holds training checkpoints: pass one of them, e.g. {str(path / steps[-1])!r}." if steps else ""
    if (path / "config.json").is_file() and ((path / "model.safetensors").is_file()
                                             or (path / "model.safetensors.index.json").is_file()):
        hint = " It is a Hugging Face model folder (use hf-to-megatron to convert it)."
    raise ConfigError(f"{str(path)!r} is not a Megatron checkpoint: no {ckpt.SUBDIR}/layout.json.{hint}")


def _check_shards(root: Path, spec: ModelSpec, saved: Layout) -> Optional[torch.dtype]:
    """Every shard file of the saved layout exists and holds every parameter of its
    position with the shape the table gives for config.json (header reads only). Returns
    the parameters' stored dtype (None when mixed)."""
    from safetensors import safe_open

    dtypes = set()
    for p in range(saved.pp):
        for t in range(saved.tp):
            lay = saved.at(t, p)
            path = root / ckpt.shard_file(t, p)
            if not path.is_file():
                raise ConfigError(f"{str(path)!r} is missing: {root / 'layout.json'} says TP{saved.tp} x PP{saved.pp}")
            try:
                f = safe_open(str(path), framework="pt")
            except Exception as e:
                raise ConfigError(f"{str(path)!r} is not a safetensors file ({e})") from None
            keys = set(f.keys())
            for name in local_names(spec, lay):
                if name not in keys:
                    raise ConfigError(f"{str(path)!r} holds no tensor {name!r} (a checkpoint of another model or "
                                      "layer spec?)")
                sl = f.get_slice(name)
                got, want = tuple(sl.get_shape()), local_shape(name, spec, lay)
                if got != want:
                    raise ConfigError(f"{str(path)!r}: tensor {name!r} has shape {list(got)}, config.json gives "
                                      f"{list(want)} at TP{saved.tp} rank {t} (a checkpoint of another model?)")
                dt = sl.get_dtype()
                if dt not in _ST_DTYPE:
                    raise ConfigError(f"{str(path)!r}: tensor {name!r} is {dt}; expected F32, BF16 or F16")
                dtypes.add(_ST_DTYPE[dt])
            del f
    return dtypes.pop() if len(dtypes) == 1 else None


def open_checkpoint(path: str | os.PathLike, hf_config: Optional[str | os.PathLike] = None) -> CheckpointSource:
    """Open and check a Megatron checkpoint (a training ``step_XXXXXX`` folder, a converted
    folder, or its ``megatron/``). config.json and the tokenizer come from ``hf_config``
    when given, else from the checkpoint folder. A training checkpoint's files are checked
    against its checksums.json first."""
    folder, root = _find_root(Path(path).expanduser())
    if (folder / "checksums.json").is_file():
        from nemo_d3s.trainer.checkpoint import verify_checkpoint

        bad = verify_checkpoint(folder)
        if bad:
            raise ConfigError(f"{str(folder)!r} is not a complete training checkpoint: {bad}")
    if hf_config is not None:
        config_dir = _resolve_hf(hf_config)
    elif (folder / "config.json").is_file():
        config_dir = folder
    else:
        raise ConfigError(
            f"{str(folder)!r} has no config.json (a training checkpoint): pass --hf-config DIR, the model folder "
            "the run started from (model.name in the run's config.yaml)")
    spec = ModelSpec.from_folder(config_dir)
    saved = ckpt.read_layout(root, spec)
    if saved.tp < 1 or saved.pp < 1 or spec.num_layers % saved.pp or saved.padded_vocab < spec.vocab_size \
            or saved.padded_vocab % saved.tp:
        raise ConfigError(f"{str(root / 'layout.json')!r}: TP{saved.tp} x PP{saved.pp} with padded vocabulary "
                          f"{saved.padded_vocab} is not a layout of this model")
    try:
        check_layout(spec, tp=saved.tp, pp=saved.pp, world=saved.tp * saved.pp)
    except ConfigError as e:
        raise ConfigError(f"{str(root / 'layout.json')!r}: {e}") from None
    dtype = _check_shards(root, spec, saved)
    return CheckpointSource(folder, root, config_dir, spec, saved, dtype)


def _dtype(name: Optional[str]) -> Optional[torch.dtype]:
    if name is None or name == "auto":
        return None
    if name not in DTYPES:
        raise ConfigError(f"--dtype={name!r} must be one of {', '.join(DTYPES)}")
    return DTYPES[name]


def _plan_hf_files(spec: ModelSpec, dtype: torch.dtype, shard_bytes: int) -> List[Tuple[str, List[str]]]:
    """HF tensor names split into files of at most ``shard_bytes`` (a larger tensor gets a
    file of its own), named as transformers names them."""
    groups: List[List[str]] = [[]]
    size = 0
    for name in hf_names(spec):
        n = _nbytes(hf_shape(name, spec), dtype)
        if groups[-1] and size + n > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += n
    if len(groups) == 1:
        return [("model.safetensors", groups[0])]
    k = len(groups)
    return [(f"model-{i + 1:05d}-of-{k:05d}.safetensors", g) for i, g in enumerate(groups)]


def megatron_to_hf(ckpt_path: str | os.PathLike, out: str | os.PathLike, *,
                   hf_config: Optional[str | os.PathLike] = None, dtype: Optional[str] = None,
                   max_shard_bytes: int = DEFAULT_SHARD_BYTES, overwrite: bool = False,
                   progress: bool = True) -> Path:
    """Convert a Megatron checkpoint (any saved TP x PP) into the HF folder ``out``.
    ``dtype`` None keeps the stored dtype; config.json says the dtype written."""
    src = open_checkpoint(ckpt_path, hf_config)
    want = _dtype(dtype) or src.dtype
    if want is None:
        raise ConfigError(f"{str(src.root)!r} stores parameters in several dtypes; pass --dtype")
    tokenizer = _tokenizer_files(src.config_dir, role="--hf-config" if hf_config is not None else "--ckpt")
    if max_shard_bytes < 1:
        raise ConfigError(f"max shard size {max_shard_bytes} must be >= 1 byte")
    files = _plan_hf_files(src.spec, want, max_shard_bytes)
    total = sum(_nbytes(hf_shape(n, src.spec), want) for n in hf_names(src.spec))
    sources = [src.folder] + ([src.config_dir] if hf_config is not None else [])
    with _staged_output(out, overwrite=overwrite, sources=sources) as tmp:
        tensors = src.iter_hf(want)
        weight_map: Dict[str, str] = {}
        with _progress(total, f"megatron-to-hf TP{src.saved.tp} x PP{src.saved.pp}", progress) as bar:
            for fname, names in files:
                with StreamingSafetensors(tmp / fname, [(n, hf_shape(n, src.spec), want) for n in names]) as w:
                    for n in names:
                        got, t = next(tensors)
                        assert got == n, (got, n)
                        w.write(n, t)
                        bar.update(_nbytes(t.shape, want))
                        weight_map[n] = fname
                        del t
        if len(files) > 1:
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        _copy_side_files(src.config_dir, tmp, tokenizer, dtype=want)
    return Path(out)


# ============================================================================ verify
@dataclass
class VerifyResult:
    """Logits of ``prompts`` prompts (``tokens`` positions in all): the HF folder vs the
    checkpoint; ``ok`` when ``max_abs_err <= atol``."""

    ok: bool
    max_abs_err: float
    atol: float
    prompts: int
    tokens: int
    layout: str

    def verdict(self) -> str:
        word = "OK" if self.ok else "MISMATCH"
        return (f"{word}: max abs logit error {self.max_abs_err:.3g} (tolerance {self.atol:g}) over {self.prompts} "
                f"prompts / {self.tokens} tokens, checkpoint {self.layout}")


def _logits(model, ids: List[torch.Tensor]) -> List[torch.Tensor]:
    with torch.no_grad():
        return [model(input_ids=x.unsqueeze(0)).logits[0].float() for x in ids]


def _hf_model_from_checkpoint(src: CheckpointSource, dtype: torch.dtype):
    """The transformers model of ``src``'s config with the checkpoint's weights, filled in
    tensor by tensor (no second copy of the model, no file written)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    config = AutoConfig.from_pretrained(str(src.config_dir), local_files_only=True)
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    params = dict(model.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        seen = set()
        for name, t in src.iter_hf():
            if name not in params:
                raise ConfigError(f"transformers' {type(model).__name__} has no parameter {name!r}")
            params[name].copy_(t)
            seen.add(name)
        if src.spec.tie_word_embeddings and "lm_head.weight" in params:
            if params["lm_head.weight"].data_ptr() != params["model.embed_tokens.weight"].data_ptr():
                params["lm_head.weight"].copy_(params["model.embed_tokens.weight"])
            seen.add("lm_head.weight")
        missing = sorted(set(params) - seen)
        if missing:
            raise ConfigError(f"the checkpoint has no weights for {missing[:3]}")
    return model.eval()


def verify(hf: str | os.PathLike, ckpt_path: str | os.PathLike, *, hf_config: Optional[str | os.PathLike] = None,
           atol: float = 1e-4, dtype: str = "float32", prompts: Sequence[str] = VERIFY_PROMPTS) -> VerifyResult:
    """Compare the logits of transformers on the HF folder ``hf`` with those of the
    checkpoint converted in memory (config from ``hf_config``, the checkpoint folder, or
    ``hf``), both computed in ``dtype``. One model is in memory at a time."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_dir = _resolve_hf(hf)
    spec = ModelSpec.from_folder(hf_dir)
    ck_folder, _ = _find_root(Path(ckpt_path).expanduser())
    cfg_dir = hf_config if hf_config is not None else (ck_folder if (ck_folder / "config.json").is_file() else hf_dir)
    src = open_checkpoint(ckpt_path, cfg_dir)
    mine, theirs = spec.to_dict(), src.spec.to_dict()
    diff = [k for k in mine if k != "torch_dtype" and mine[k] != theirs[k]]
    if diff:
        raise ConfigError(f"{str(hf_dir)!r} and {str(src.folder)!r} are different models: "
                          f"{diff[0]}={mine[diff[0]]!r} vs {theirs[diff[0]]!r}")
    compute = _dtype(dtype) or torch.float32
    tok = AutoTokenizer.from_pretrained(str(hf_dir), local_files_only=True)
    ids = []
    for p in prompts:
        x = torch.tensor(tok(p)["input_ids"], dtype=torch.long)
        ids.append(x.clamp(max=spec.vocab_size - 1))
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=compute, local_files_only=True).eval()
    want = _logits(model, ids)
    del model
    gc.collect()
    model = _hf_model_from_checkpoint(src, compute)
    got = _logits(model, ids)
    del model
    gc.collect()
    err = max(float((a - b).abs().max()) for a, b in zip(got, want))
    ok = math.isfinite(err) and err <= atol
    return VerifyResult(ok=ok, max_abs_err=err, atol=atol, prompts=len(ids), tokens=sum(len(x) for x in ids),
                        layout=f"TP{src.saved.tp} x PP{src.saved.pp}")
