"""Checkpoint conversion between Hugging Face folders, the Megatron backend's sharded checkpoints
(a mixture of experts' expert files at any EP x ETP too) and NeMo 2, on the one weight table
(``formats/weights.py``) the backend loads and exports through. Tensors stream one local
parameter group at a time into safetensors files planned up front, so peak memory is near the
largest group (the embedding), not the model. Every file read is untrusted (safetensors, JSON,
safe YAML); a bad input is a ConfigError naming the file or tensor before anything is written,
and output goes through ``files.atomic_folder``.
"""

from __future__ import annotations

import errno

import os
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, List, Optional, Sequence

import torch

from nemo_d3s.core.checks import is_count
from nemo_d3s.convert.sources import (
    DTYPES,
    NEMO2_FIELDS_IGNORED,
    CheckpointSource,
    parse_dtype,
    folder_side_files,
    resolve_hf,
    check_same_model,
    with_side_files,
    open_checkpoint,
)
from nemo_d3s.errors import ConfigError, RunError
from nemo_d3s.files import (
    FolderBusy,
    FolderNotEmpty,
    atomic_folder,
    looks_like_write_failure,
    space_note,
    write_checksums,
)
from nemo_d3s.formats.detect import MEGATRON, MEGATRON_LM, NEMO2, detect_format
from nemo_d3s.formats.nemo2_context import hf_config_from_nemo, nemo_make_vocab_size_divisible_by
from nemo_d3s.formats.safetensors_stream import (
    DEFAULT_SHARD_BYTES,
    StreamingSafetensors,
    nbytes,
    write_hf_weights,
)
from nemo_d3s.formats.shards import SUBDIR, ST_DTYPES, shard_plan, write_layout
from nemo_d3s.formats.spec import ModelSpec, check_layout, padded_vocab_size, smallest_world
from nemo_d3s.formats.weights import (
    Layout,
    SafetensorsReader,
    hf_names,
    hf_shape,
    local_parts,
    local_shape,
    read_local,
)

__all__ = ["DTYPES", "DEFAULT_SHARD_BYTES", "hf_to_megatron", "megatron_to_hf", "megatron_to_nemo"]


# ============================================================================ output folders
@contextmanager
def staged_output(
    out: str | os.PathLike, *, overwrite: bool, sources: Sequence[Path]
) -> Iterator[Path]:
    """``files.atomic_folder`` for ``out``: written into a hidden sibling, renamed into place on
    success and removed on an error or interrupt. Refuses a non-empty ``out`` unless
    ``overwrite``, an ``out`` that is, holds or lies inside a source, and a second conversion into
    the same ``out`` at once (naming the first).
    """
    dest = Path(out).expanduser().absolute()
    for src in sources:
        s = Path(src).resolve()
        d = dest.resolve()
        if d == s or d in s.parents:
            raise ConfigError(
                f"--out {str(dest)!r} is (or holds) the source {str(src)!r}; choose another folder"
            )
        if s in d.parents:
            raise ConfigError(
                f"--out {str(dest)!r} is inside the source {str(src)!r}; choose a folder outside it"
            )
    if dest.exists() and not dest.is_dir():
        raise ConfigError(f"--out {str(dest)!r} exists and is not a folder")
    if dest.is_dir() and any(dest.iterdir()) and not overwrite:
        raise ConfigError(f"--out {str(dest)!r} is not empty; pass --overwrite to replace it")
    try:
        with atomic_folder(dest, replace=overwrite) as tmp:
            try:
                yield tmp
            # a full disk or a file-size limit, however it surfaces (torch.distributed.checkpoint's
            # CheckpointException is a BaseException)
            except BaseException as e:
                if not _out_of_room(e):
                    raise
                last = [x.strip() for x in str(e).splitlines() if x.strip()] or [repr(e)]
                raise RunError(
                    f"could not write --out {str(dest)!r}: {last[-1]} "
                    f"({space_note(dest.parent)}); nothing was written"
                ) from None
    except FolderBusy as e:
        raise ConfigError(
            f"--out {str(dest)!r} is being written by another conversion ({e.holder}); wait for it "
            "to end, or choose another --out"
        ) from None
    except FolderNotEmpty:  # it filled up between the check above and the lock
        raise ConfigError(
            f"--out {str(dest)!r} is not empty; pass --overwrite to replace it"
        ) from None


def _out_of_room(e: BaseException) -> bool:
    """A write that failed for want of space or of file size (not a read, not a bug)."""
    if isinstance(e, OSError):
        return e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
    return looks_like_write_failure(e)


def progress_bar(total: int, desc: str, enabled: bool):
    """A byte-counting tqdm bar, shown on a terminal only (``enabled`` False: none)."""
    from tqdm.auto import tqdm

    # disable=None: shown on a terminal only (no progress lines in logs and test output)
    return tqdm(
        total=total,
        desc=desc,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        disable=None if enabled else True,
        leave=False,
    )


# ============================================================================ HF -> Megatron
def _source_dtype(
    reader: SafetensorsReader, name: str, spec: ModelSpec, layout: Layout
) -> torch.dtype:
    """The stored dtype of the first HF tensor local parameter ``name`` is made of."""
    from safetensors import safe_open

    for part in local_parts(name, spec, layout)[1]:
        if part.hf_name is not None:
            with safe_open(str(reader.files[part.hf_name]), framework="pt") as f:
                got = f.get_slice(part.hf_name).get_dtype()
            if got not in ST_DTYPES:
                raise ConfigError(
                    f"{str(reader.files[part.hf_name])!r}: tensor {part.hf_name!r} is {got}; "
                    "expected F32, BF16 or F16"
                )
            return ST_DTYPES[got]
    return torch.float32


def hf_to_megatron(
    hf: str | os.PathLike,
    out: str | os.PathLike,
    *,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    etp: Optional[int] = None,
    dtype: Optional[str] = None,
    make_vocab_size_divisible_by: int = 128,
    overwrite: bool = False,
    progress: bool = True,
    verify_checksums: bool = True,
) -> Path:
    """Convert ``hf`` (an HF folder, or a NeMo 2 / Megatron-LM checkpoint) into the Megatron folder
    ``out``: config, tokenizer, ``megatron/`` TP x PP shards (a mixture of experts' also EP x
    ETP x PP expert files; ``etp`` None = TP; no optimizer state) and ``checksums.json``.
    ``dtype`` None keeps each tensor's stored dtype. Returns ``out``.
    """
    etp = tp if etp is None else etp
    for name, v in (
        ("tp", tp),
        ("pp", pp),
        ("ep", ep),
        ("etp", etp),
        ("make_vocab_size_divisible_by", make_vocab_size_divisible_by),
    ):
        if not is_count(v, 1):
            raise ConfigError(f"--{name.replace('_', '-')}={v!r} must be an integer >= 1")
    want = parse_dtype(dtype)
    fmt = detect_format(Path(hf).expanduser())
    if fmt.kind == MEGATRON:  # it holds a config.json too: name what it is instead
        raise ConfigError(
            f"--hf {str(hf)!r} is a Megatron checkpoint ({fmt.folder}/megatron/layout.json), not "
            "a Hugging Face folder: it needs no hf-to-megatron; to change its TP x PP, convert it "
            "back with megatron-to-hf and that folder forward again"
        )
    if fmt.kind in (NEMO2, MEGATRON_LM):
        nemo = with_side_files(
            open_checkpoint(Path(hf).expanduser(), None, verify_checksums=verify_checksums),
            role="checkpoint",
        )
        src, spec, side, reader = nemo.folder, nemo.spec, nemo.side, nemo.reader()
        dtype_of = lambda name, lay: want or nemo.dtype  # noqa: E731
        close = lambda: None  # noqa: E731
    else:
        src = resolve_hf(hf)
        spec = ModelSpec.from_folder(src)
        reader = SafetensorsReader(src, spec)
        reader.check()
        side = folder_side_files(src, role="--hf")
        dtype_of = lambda name, lay: want or _source_dtype(reader, name, spec, lay)  # noqa: E731
        close = reader.close
    try:
        check_layout(spec, tp=tp, pp=pp, world=smallest_world(tp, pp, ep, etp), ep=ep, etp=etp)
        layout = Layout(
            tp=tp,
            pp=pp,
            padded_vocab=padded_vocab_size(spec.vocab_size, tp, make_vocab_size_divisible_by),
            ep=ep,
            etp=etp,
        )
        plan = [  # (file, its position's layout, [(local name, shape, dtype)])
            (fname, lay, [(n, local_shape(n, spec, lay), dtype_of(n, lay)) for n in names])
            for fname, lay, names in shard_plan(spec, layout)
        ]
        total = sum(nbytes(s, d) for _, _, entries in plan for _, s, d in entries)
        with staged_output(out, overwrite=overwrite, sources=[src]) as tmp:
            root = tmp / SUBDIR
            root.mkdir()
            what = f"TP{tp} x PP{pp}" + (f" x EP{ep} x ETP{etp}" if spec.num_experts else "")
            with progress_bar(total, f"hf-to-megatron {what}", progress) as bar:
                for fname, lay, entries in plan:
                    with StreamingSafetensors(
                        root / fname,
                        entries,
                        {"format": "pt", "written_by": "nemo-d3s-convert hf-to-megatron"},
                    ) as w:
                        for name, _, dt in entries:
                            t = read_local(name, spec, lay, reader, dt)
                            w.write(name, t)
                            bar.update(nbytes(t.shape, dt))
                            del t
                            close()  # unmap the source files: their read pages would stay resident
            write_layout(root, spec, layout)
            side.write(tmp, want)
            write_checksums(tmp)  # last: covers every file above
    finally:
        close()
    return Path(out)


# ============================================================================ Megatron -> HF
def _sources(src: CheckpointSource) -> List[Path]:
    return [src.folder] + ([src.config_source] if src.config_source is not None else [])


def megatron_to_hf(
    ckpt_path: str | os.PathLike,
    out: str | os.PathLike,
    *,
    hf_config: Optional[str | os.PathLike] = None,
    dtype: Optional[str] = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    overwrite: bool = False,
    progress: bool = True,
    verify_checksums: bool = True,
) -> Path:
    """Convert a Megatron (any saved TP x PP) or NeMo 2 checkpoint into the HF folder ``out``;
    ``dtype`` None keeps the stored dtype. Checksums are checked first unless ``verify_checksums``
    is False.
    """
    src = with_side_files(
        open_checkpoint(ckpt_path, hf_config, verify_checksums=verify_checksums), role="--hf-config"
    )
    want = parse_dtype(dtype) or src.dtype
    if want is None:
        raise ConfigError(f"{str(src.folder)!r} stores parameters in several dtypes; pass --dtype")
    if src.origin and progress:  # a Megatron-LM / Megatron-Bridge source: say what it was read as
        print(f"{src.layout}: the model's architecture from {src.origin}", file=sys.stderr)
    if max_shard_bytes < 1:
        raise ConfigError(f"max shard size {max_shard_bytes} must be >= 1 byte")
    entries = [(n, hf_shape(n, src.spec), want) for n in hf_names(src.spec)]
    total = sum(nbytes(shape, want) for _, shape, _ in entries)
    with staged_output(out, overwrite=overwrite, sources=_sources(src)) as tmp:
        with progress_bar(total, f"megatron-to-hf {src.layout}", progress) as bar:
            write_hf_weights(
                tmp,
                src.iter_hf(want),
                entries,
                max_shard_bytes,
                on_tensor=lambda t: bar.update(nbytes(t.shape, want)),
            )
        src.side.write(tmp, want)
    return Path(out)


# ============================================================================ -> NeMo 2
def megatron_to_nemo(
    ckpt_path: str | os.PathLike,
    out: str | os.PathLike,
    *,
    nemo_context: str | os.PathLike,
    hf_config: Optional[str | os.PathLike] = None,
    dtype: Optional[str] = None,
    overwrite: bool = False,
    progress: bool = True,
    verify_checksums: bool = True,
) -> Path:
    """Write a checkpoint (Megatron, any layout, or NeMo 2) as the NeMo 2 checkpoint ``out``:
    ``weights/`` by megatron-core's dist_checkpointing under NeMo's names, ``context/`` copied from
    ``nemo_context`` (a NeMo 2 checkpoint of the same model). ``dtype`` None: the context's
    params_dtype. ``out`` carries a checksums.json (NeMo ignores it).
    """
    from nemo_d3s.backends.megatron import nemo2_writer  # megatron-core's dist_checkpointing

    src = open_checkpoint(ckpt_path, hf_config, verify_checksums=verify_checksums)
    ctx = Path(nemo_context).expanduser()
    if ctx.name == "context" and (ctx / "model.yaml").is_file():
        ctx = ctx.parent
    if not (ctx / "context" / "model.yaml").is_file():
        raise ConfigError(
            f"--nemo-context {str(ctx)!r} is not a NeMo 2 checkpoint (no context/model.yaml)"
        )
    cfg = hf_config_from_nemo(ctx)
    check_same_model(
        src.spec,
        ModelSpec.from_hf_dict(cfg, str(ctx / "context" / "model.yaml")),
        f"{str(src.folder)!r}",
        f"{str(ctx / 'context')!r}",
        ignore=tuple(set(src.ignored) | set(NEMO2_FIELDS_IGNORED)),  # the context's seq_length
    )
    want = parse_dtype(dtype) or DTYPES[cfg["torch_dtype"]]
    padded = padded_vocab_size(src.spec.vocab_size, 1, nemo_make_vocab_size_divisible_by(ctx))
    total = sum(nbytes(hf_shape(n, src.spec), want) for n in hf_names(src.spec))
    with staged_output(out, overwrite=overwrite, sources=_sources(src) + [ctx]) as tmp:
        with progress_bar(total, f"to NeMo 2 from {src.layout}", progress) as bar:

            def counted():
                for name, t in src.iter_hf(want):
                    bar.update(nbytes(t.shape, want))
                    yield name, t

            nemo2_writer.write_nemo2(counted(), src.spec, tmp, padded_vocab=padded)
        shutil.copytree(ctx / "context", tmp / "context", symlinks=False)
        write_checksums(tmp)
    return Path(out)
