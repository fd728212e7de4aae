"""What a conversion reads: a checkpoint of any supported kind opened and checked
(:func:`open_checkpoint`) and the files that go with its weights (:class:`SideFiles`). Every
file is untrusted; anything wrong is a ConfigError naming the file or tensor.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from nemo_d3s.errors import ConfigError
from nemo_d3s.formats.checksums import check_checksums, checksum_error, has_checksums
from nemo_d3s.formats.detect import (
    HF,
    LAYOUT_FILE,
    MEGATRON,
    MEGATRON_LM,
    NEMO2,
    SHARDS_SUBDIR,
    FolderFormat,
    detect_format,
)
from nemo_d3s.formats.mcore_config import checkpoint_hf_config, resolve_iteration
from nemo_d3s.formats.mcore_config import tokenizer_folder as mcore_tokenizer_folder
from nemo_d3s.formats.mcore_dist import open_mcore_weights
from nemo_d3s.formats.nemo2 import open_nemo2_weights
from nemo_d3s.formats.nemo2_context import hf_config_from_nemo
from nemo_d3s.formats.side_files import (
    GENERATION_CONFIG,
    generation_file,
    nemo2_side_files,
    read_json,
    tokenizer_files,
)
from nemo_d3s.formats.shards import ShardedReader, check_shards, read_layout
from nemo_d3s.formats.spec import ModelSpec, read_hf_config
from nemo_d3s.formats.weights import hf_names, hf_shape

__all__ = [
    "DTYPES",
    "GENERATION_CONFIG",
    "NEMO2_FIELDS_IGNORED",
    "SideFiles",
    "CheckpointSource",
    "open_checkpoint",
]

DTYPES: Dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

SKIP_HINT = "pass --no-verify-checksums"


@dataclass
class SideFiles:
    """What goes with the weights: the HF config (``config_file`` is copied byte for byte
    when the dtype stays), the generation config and the tokenizer files."""

    config: Dict[str, Any]
    config_file: Optional[Path]
    generation: Optional[Path]
    tokenizer: List[Path]

    def write(self, dst: Path, dtype: Optional[torch.dtype]) -> None:
        cfg = dict(self.config)
        key = "torch_dtype" if "torch_dtype" in cfg else "dtype"
        want = None if dtype is None else str(dtype).replace("torch.", "")
        if self.config_file is not None and (want is None or cfg.get(key) == want):
            shutil.copyfile(self.config_file, dst / "config.json")
        else:
            if want is not None:
                cfg[key] = want
            (dst / "config.json").write_text(
                json.dumps(cfg, indent=2, sort_keys=True) + "\n", encoding="utf-8"
            )
        if self.generation is not None:
            shutil.copyfile(self.generation, dst / GENERATION_CONFIG)
        for p in self.tokenizer:
            shutil.copyfile(p, dst / p.name)


def _tokenizer_files(folder: Path, *, role: str) -> List[Path]:
    hint = (
        "a model folder must hold its tokenizer"
        if role == "--hf"
        else "pass --hf-config DIR, the model folder the checkpoint was trained from"
    )
    return tokenizer_files(folder, role=role, hint=hint)


def folder_side_files(folder: Path, *, role: str) -> SideFiles:
    """Side files of an HF model folder (or a converted checkpoint folder)."""
    return SideFiles(
        read_hf_config(folder),
        folder / "config.json",
        generation_file(folder / GENERATION_CONFIG),
        _tokenizer_files(folder, role=role),
    )


def _nemo_side_files(folder: Path) -> SideFiles:
    """Side files of a NeMo 2 checkpoint: config from context/model.yaml, tokenizer from
    context/nemo_tokenizer/, generation config from context/artifacts/."""
    hint = "pass --hf-config DIR, the model folder the checkpoint was trained from"
    config, generation, tokenizer = nemo2_side_files(folder, hint=hint)
    return SideFiles(config, None, generation, tokenizer)


@dataclass
class CheckpointSource:
    """A checkpoint opened and checked (``kind`` "megatron", any saved TP x PP, or "nemo2");
    ``reader()`` gives HF-named rows through the weight table; ``side`` is its side files (None
    until :func:`with_side_files`).
    """

    kind: str
    folder: Path
    spec: ModelSpec
    layout: str
    dtype: Optional[torch.dtype]  # None: the parameters are stored in several dtypes
    _reader: Any
    config_source: Optional[Path] = None  # a separate folder the config came from (--hf-config)
    side: Optional[SideFiles] = None
    origin: str = ""  # where the model's architecture came from, in words
    weights: Optional[Path] = None  # MEGATRON_LM: the iteration folder read
    # spec fields its source does not state as the model (check_same_model skips them)
    ignored: Tuple[str, ...] = ("torch_dtype",)

    def reader(self):
        return self._reader()

    def hf_config(self) -> Dict[str, Any]:
        """The HF config dict of the model (no tokenizer needed)."""
        if self.side is not None:
            return dict(self.side.config)
        if self.config_source is not None:
            return read_hf_config(self.config_source)
        if self.kind == NEMO2:
            return hf_config_from_nemo(self.folder)
        if self.kind == MEGATRON_LM:
            return checkpoint_hf_config(self.weights)[0]
        return read_hf_config(self.folder)

    def iter_hf(self, dtype: Optional[torch.dtype] = None) -> Iterator[Tuple[str, torch.Tensor]]:
        """(HF name, full tensor) in transformers' order, one parameter group in memory."""
        reader = self.reader()
        for name in hf_names(self.spec):
            shape = hf_shape(name, self.spec)
            t = reader.rows(name, 0, 0, shape[0])
            yield name, (t if dtype is None else t.to(dtype))


def find_root(path: Path) -> FolderFormat:
    """The Megatron checkpoint at ``path`` (a checkpoint folder or its megatron/); a
    ConfigError saying what ``path`` is instead."""
    fmt = detect_format(path)
    if fmt.kind == MEGATRON:
        return fmt
    if not path.exists():
        raise ConfigError(f"--ckpt {str(path)!r}: no such folder")
    steps = (
        sorted(p.name for p in path.iterdir() if p.is_dir() and p.name.startswith("step_"))
        if path.is_dir()
        else []
    )
    hint = (
        f" It holds training checkpoints: pass one of them, e.g. {str(path / steps[-1])!r}."
        if steps
        else ""
    )
    if fmt.kind == HF:
        hint = " It is a Hugging Face model folder (use hf-to-megatron to convert it)."
    raise ConfigError(
        f"{str(path)!r} is not a Megatron checkpoint: no {SHARDS_SUBDIR}/{LAYOUT_FILE} "
        f"(nor a NeMo 2 checkpoint: no weights/metadata.json + context/).{hint}"
    )


def _open_nemo2(
    folder: Path, hf_config: Optional[str | os.PathLike], verify_checksums: bool = True
) -> CheckpointSource:
    """A NeMo 2 checkpoint: the model from context/model.yaml. Its seq_length, the training
    sequence length (fine-tuning recipes set it, 2048 by default), stands in for
    max_position_embeddings, which NeMo 2 does not record: with ``hf_config`` (checked to
    be the same model, that field aside) the model's own max_position_embeddings is taken
    from there; without, the exported config.json says seq_length."""
    check_checksums(folder, verify=verify_checksums, skip_hint=SKIP_HINT)
    cfg = hf_config_from_nemo(folder)
    spec = ModelSpec.from_hf_dict(cfg, str(folder / "context" / "model.yaml"))
    config_source, ignored = None, NEMO2_FIELDS_IGNORED
    if hf_config is not None:  # its config must describe the same model
        config_source = resolve_hf(hf_config)
        other = ModelSpec.from_folder(config_source)
        check_same_model(
            other,
            spec,
            str(config_source / "config.json"),
            str(folder / "context" / "model.yaml"),
            ignore=NEMO2_FIELDS_IGNORED,
        )
        spec = replace(spec, max_position_embeddings=other.max_position_embeddings)
        ignored = ("torch_dtype",)
    _, dtype = open_nemo2_weights(folder, spec)
    return CheckpointSource(
        NEMO2,
        folder,
        spec,
        "NeMo 2",
        dtype,
        lambda: open_nemo2_weights(folder, spec)[0],
        config_source,
        ignored=ignored,
    )


# NeMo 2's model.yaml holds no max_position_embeddings: the seq_length read as it is the
# training sequence length, which fine-tuning changes; and the dtype.
NEMO2_FIELDS_IGNORED = ("max_position_embeddings", "torch_dtype")
# What a checkpoint's own description may leave out or state otherwise without being another
# model: the family name (Megatron holds none: a Mistral reads as a Llama), the training
# sequence length Megatron-LM / Megatron-Bridge record as seq_length, the dtype.
_DESCRIPTION_FIELDS_IGNORED = ("architecture", "model_type") + NEMO2_FIELDS_IGNORED


def _open_mcore(
    path: Path, hf_config: Optional[str | os.PathLike], verify_checksums: bool = True
) -> CheckpointSource:
    """A Megatron-LM / Megatron-Bridge checkpoint: the model from ``--hf-config`` when given
    (checked against the checkpoint's own complete description), else from that description.
    """
    check_checksums(path, verify=verify_checksums, skip_hint=SKIP_HINT)  # nemo_d3s-written only
    it = resolve_iteration(path)
    config_source = None
    if hf_config is not None:
        config_source = resolve_hf(hf_config)
        spec = ModelSpec.from_folder(config_source)
        origin = f"--hf-config {str(config_source / 'config.json')!r}"
        try:
            own, where = checkpoint_hf_config(it)
        except ConfigError:  # no complete description (Megatron-LM without --vocab-size)
            own = None
        if own is not None:
            theirs = ModelSpec.from_hf_dict(own, where)
            check_same_model(spec, theirs, origin, where, ignore=_DESCRIPTION_FIELDS_IGNORED)
        ignored: Tuple[str, ...] = ("torch_dtype",)
    else:
        cfg, origin = checkpoint_hf_config(it)
        spec = ModelSpec.from_hf_dict(cfg, origin)
        ignored = _DESCRIPTION_FIELDS_IGNORED
    _, dtype = open_mcore_weights(it, spec, origin)
    return CheckpointSource(
        MEGATRON_LM,
        path,
        spec,
        f"Megatron-LM torch_dist {it.name}",
        dtype,
        lambda: open_mcore_weights(it, spec, origin)[0],
        config_source,
        origin=origin,
        weights=it,
        ignored=ignored,
    )


def _mcore_side_files(it: Path) -> SideFiles:
    """Side files of a Megatron-LM / Megatron-Bridge checkpoint: config from its own
    description, tokenizer (and generation config) from Megatron-Bridge's tokenizer/."""
    cfg, _ = checkpoint_hf_config(it)
    tok = mcore_tokenizer_folder(it)
    if tok is None:
        raise ConfigError(
            f"{str(it)!r} holds no tokenizer/ (Megatron-LM keeps none; Megatron-Bridge keeps one "
            "unless save_tokenizer_assets=false): pass --hf-config DIR, the model's HF folder"
        )
    gen = generation_file(tok / GENERATION_CONFIG)
    if gen is not None:
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = read_json(gen).get(key)
            if value is not None:
                cfg[key] = value
    return SideFiles(cfg, None, gen, _tokenizer_files(tok, role="checkpoint tokenizer/"))


def check_same_model(
    a: ModelSpec,
    b: ModelSpec,
    where_a: str,
    where_b: str,
    *,
    ignore: Sequence[str] = ("torch_dtype",),
) -> None:
    """ConfigError naming the first field (those in ``ignore`` aside: the dtype, and what a
    checkpoint's own description does not state as the model, ``CheckpointSource.ignored``)
    in which two model specs differ."""
    da, db = a.to_dict(), b.to_dict()
    diff = [k for k in da if k not in ignore and da[k] != db[k]]
    if diff:
        raise ConfigError(
            f"{where_a} and {where_b} are different models: {diff[0]}={da[diff[0]]!r} vs "
            f"{db[diff[0]]!r}"
        )


def open_checkpoint(
    path: str | os.PathLike,
    hf_config: Optional[str | os.PathLike] = None,
    *,
    verify_checksums: bool = True,
) -> CheckpointSource:
    """Open and check a Megatron checkpoint (training ``step_XXXXXX``, converted, or its
    ``megatron/``; config.json from ``hf_config``, else the checkpoint folder) or a NeMo 2 one
    (``context/model.yaml``), after its checksums.json unless ``verify_checksums`` is False.
    """
    p = Path(path).expanduser()
    kind = detect_format(p).kind
    if kind == NEMO2:
        return _open_nemo2(p, hf_config, verify_checksums)
    if kind == MEGATRON_LM:
        return _open_mcore(p, hf_config, verify_checksums)
    fmt = find_root(p)
    folder, root = fmt.folder, fmt.shards
    if verify_checksums and fmt.training and has_checksums(folder):
        from nemo_d3s.trainer.checkpoint import verify_checkpoint  # as the trainer checks its own

        bad = verify_checkpoint(folder)
        if bad:
            raise checksum_error(folder, bad, SKIP_HINT)
    else:
        check_checksums(folder, verify=verify_checksums, skip_hint=SKIP_HINT)
    if hf_config is not None:
        config_dir = resolve_hf(hf_config)
    elif (folder / "config.json").is_file():
        config_dir = folder
    else:
        raise ConfigError(
            f"{str(folder)!r} has no config.json (a training checkpoint written before "
            "checkpoints kept their model's files): pass --hf-config DIR, the model "
            "folder the run started from (model.name in the run's config.yaml)"
        )
    spec = ModelSpec.from_folder(config_dir)
    saved = read_layout(root, spec)  # with its sizes checked against the model
    dtype = check_shards(root, spec, saved)
    return CheckpointSource(
        MEGATRON,
        folder,
        spec,
        f"TP{saved.tp} x PP{saved.pp}",
        dtype,
        lambda: ShardedReader(root, spec, saved),
        config_dir if config_dir != folder else None,
    )


def with_side_files(src: CheckpointSource, *, role: str) -> CheckpointSource:
    """``src`` with its side files found and checked (tokenizer files are required)."""
    if src.config_source is not None:
        src.side = folder_side_files(src.config_source, role=role)
    elif src.kind == NEMO2:
        src.side = _nemo_side_files(src.folder)
    elif src.kind == MEGATRON_LM:
        src.side = _mcore_side_files(src.weights)
    else:
        src.side = folder_side_files(src.folder, role="--ckpt")
    return src


def parse_dtype(name: Optional[str]) -> Optional[torch.dtype]:
    """``--dtype``: None for ``auto`` or absent, else the torch dtype; ConfigError otherwise."""
    if name is None or name == "auto":
        return None
    if name not in DTYPES:
        raise ConfigError(f"--dtype={name!r} must be one of {', '.join(DTYPES)}")
    return DTYPES[name]


def resolve_hf(hf: str | os.PathLike) -> Path:
    """The Hugging Face folder ``hf`` names (a path or the bundled default); ConfigError if none."""
    from nemo_d3s.backends.hf.loading import resolve_model_path

    try:
        return Path(resolve_model_path(str(hf)))
    except FileNotFoundError as e:
        raise ConfigError(str(e)) from None
