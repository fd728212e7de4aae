"""Checkpoint conversion between Hugging Face folders and the Megatron backend's sharded
checkpoints, on the backend's one weight table (``backends.megatron.weights``).

- :func:`hf_to_megatron`: an HF folder -> ``OUT/config.json`` + tokenizer +
  ``OUT/megatron/{layout.json, tpXX_ppYY.safetensors}`` at any TP x PP (no optimizer
  state): what ``MegatronBackend(model=OUT)`` starts from. One process writes every shard.
- :func:`megatron_to_hf`: a training checkpoint (``output_dir/checkpoints/step_XXXXXX``, any
  saved layout) or a converted one -> an HF folder (safetensors shards + index, config.json
  with its dtype, generation config, tokenizer) that transformers loads.
- :func:`megatron_to_nemo`: any checkpoint -> a NeMo 2 checkpoint (``nemo2.py``); NeMo 2
  checkpoints are also read as a source by every command.
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

from nemo_d3s.backends.hf.loading import copy_hf_weights
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
from nemo_d3s.errors import ConfigError

__all__ = [
    "DTYPES",
    "StreamingSafetensors",
    "CheckpointSource",
    "VerifyResult",
    "hf_to_megatron",
    "megatron_to_hf",
    "megatron_to_nemo",
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
            (dst / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        if self.generation is not None:
            shutil.copyfile(self.generation, dst / GENERATION_CONFIG)
        for p in self.tokenizer:
            shutil.copyfile(p, dst / p.name)


def _tokenizer_files(folder: Path, *, role: str) -> List[Path]:
    """The tokenizer files of ``folder``; ConfigError naming what is missing."""
    have = [folder / n for n in _TOKENIZER_FILES if (folder / n).is_file()]
    names = {p.name for p in have}
    missing = [n for n in ("tokenizer_config.json",) if n not in names]
    if not any(n in names for n in _TOKENIZER_MODEL):
        missing.append(" or ".join(_TOKENIZER_MODEL))
    if missing:
        hint = ("a model folder must hold its tokenizer" if role == "--hf" else
                "pass --hf-config DIR, the model folder the checkpoint was trained from")
        raise ConfigError(f"{str(folder)!r} ({role}) has no tokenizer: missing {', '.join(missing)}; the converted "
                          f"model needs its tokenizer files ({hint})")
    for p in have:
        if p.suffix == ".json":
            _read_json(p)
    return have


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{str(path)!r} is not valid JSON: {e}") from None


def _generation_file(path: Path) -> Optional[Path]:
    if not path.is_file():
        return None
    if not isinstance(_read_json(path), dict):
        raise ConfigError(f"{str(path)!r} must hold a JSON object")
    return path


def _folder_side_files(folder: Path, *, role: str) -> SideFiles:
    """Side files of an HF model folder (or a converted checkpoint folder)."""
    return SideFiles(read_hf_config(folder), folder / "config.json", _generation_file(folder / GENERATION_CONFIG),
                     _tokenizer_files(folder, role=role))


def _nemo_side_files(folder: Path) -> SideFiles:
    """Side files of a NeMo 2 checkpoint: config from context/model.yaml, tokenizer from
    context/nemo_tokenizer/, generation config from context/artifacts/."""
    from nemo_d3s.backends.megatron import nemo2

    return SideFiles(nemo2.hf_config_from_nemo(folder), None,
                     _generation_file(folder / "context" / "artifacts" / GENERATION_CONFIG),
                     _tokenizer_files(folder / "context" / "nemo_tokenizer", role="NeMo 2 context"))


# ============================================================================ sources
@dataclass
class CheckpointSource:
    """A checkpoint opened for reading and checked: a Megatron checkpoint (``kind``
    "megatron": training or converted, any saved TP x PP) or a NeMo 2 checkpoint ("nemo2").
    ``reader()`` gives HF-named rows (``weights.read_local``'s reader protocol) through the
    weight table; ``side`` is config.json / generation config / tokenizer (None until
    :func:`_with_side_files` is asked for them)."""

    kind: str
    folder: Path
    spec: ModelSpec
    layout: str
    dtype: Optional[torch.dtype]  # None: the parameters are stored in several dtypes
    _reader: Any
    config_source: Optional[Path] = None  # a separate folder the config came from (--hf-config)
    side: Optional[SideFiles] = None

    def reader(self):
        return self._reader()

    def hf_config(self) -> Dict[str, Any]:
        """The HF config dict of the model (no tokenizer needed)."""
        if self.side is not None:
            return dict(self.side.config)
        if self.config_source is not None:
            return read_hf_config(self.config_source)
        if self.kind == "nemo2":
            from nemo_d3s.backends.megatron.nemo2 import hf_config_from_nemo

            return hf_config_from_nemo(self.folder)
        return read_hf_config(self.folder)

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
    raise ConfigError(f"{str(path)!r} is not a Megatron checkpoint: no {ckpt.SUBDIR}/layout.json (nor a NeMo 2 "
                      f"checkpoint: no weights/metadata.json + context/).{hint}")


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


def _open_nemo2(folder: Path, hf_config: Optional[str | os.PathLike]) -> CheckpointSource:
    from nemo_d3s.backends.megatron import nemo2

    cfg = nemo2.hf_config_from_nemo(folder)
    spec = ModelSpec.from_hf_dict(cfg, str(folder / "context" / "model.yaml"))
    config_source = None
    if hf_config is not None:  # its config must describe the same model
        config_source = _resolve_hf(hf_config)
        other = ModelSpec.from_folder(config_source)
        _same_model(other, spec, str(config_source / "config.json"), str(folder / "context" / "model.yaml"))
    _, dtype = nemo2.open_nemo2_weights(folder, spec)
    return CheckpointSource("nemo2", folder, spec, "NeMo 2", dtype,
                            lambda: nemo2.open_nemo2_weights(folder, spec)[0], config_source)


def _same_model(a: ModelSpec, b: ModelSpec, where_a: str, where_b: str) -> None:
    da, db = a.to_dict(), b.to_dict()
    diff = [k for k in da if k != "torch_dtype" and da[k] != db[k]]
    if diff:
        raise ConfigError(f"{where_a} and {where_b} are different models: {diff[0]}={da[diff[0]]!r} vs "
                          f"{db[diff[0]]!r}")


def open_checkpoint(path: str | os.PathLike, hf_config: Optional[str | os.PathLike] = None) -> CheckpointSource:
    """Open and check a checkpoint: a Megatron one (a training ``step_XXXXXX`` folder, a
    converted folder, or its ``megatron/``; config.json from ``hf_config`` when given, else
    from the checkpoint folder; a training checkpoint's files are checked against its
    checksums.json first) or a NeMo 2 one (config from ``context/model.yaml``)."""
    from nemo_d3s.backends.megatron.nemo2 import is_nemo2

    p = Path(path).expanduser()
    if is_nemo2(p):
        return _open_nemo2(p, hf_config)
    folder, root = _find_root(p)
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
    return CheckpointSource("megatron", folder, spec, f"TP{saved.tp} x PP{saved.pp}", dtype,
                            lambda: ckpt.ShardedReader(root, spec, saved), config_dir if config_dir != folder else None)


def _with_side_files(src: CheckpointSource, *, role: str) -> CheckpointSource:
    """``src`` with its side files found and checked (tokenizer files are required)."""
    if src.config_source is not None:
        src.side = _folder_side_files(src.config_source, role=role)
    elif src.kind == "nemo2":
        src.side = _nemo_side_files(src.folder)
    else:
        src.side = _folder_side_files(src.folder, role="--ckpt")
    return src


def _dtype(name: Optional[str]) -> Optional[torch.dtype]:
    if name is None or name == "auto":
        return None
    if name not in DTYPES:
        raise ConfigError(f"--dtype={name!r} must be one of {', '.join(DTYPES)}")
    return DTYPES[name]


def _resolve_hf(hf: str | os.PathLike) -> Path:
    from nemo_d3s.backends.hf.loading import resolve_model_path

    try:
        return Path(resolve_model_path(str(hf)))
    except FileNotFoundError as e:
        raise ConfigError(str(e)) from None


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


def hf_to_megatron(hf: str | os.PathLike, out: str | os.PathLike, *, tp: int = 1, pp: int = 1,
                   dtype: Optional[str] = None, make_vocab_size_divisible_by: int = 128, overwrite: bool = False,
                   progress: bool = True) -> Path:
    """Convert the HF folder ``hf`` (or a NeMo 2 checkpoint: a training start from NeMo)
    into a Megatron checkpoint folder ``out`` with TP x PP shard files (see the module
    docstring). ``dtype`` None keeps every tensor's stored dtype. Returns ``out``."""
    from nemo_d3s.backends.megatron.nemo2 import is_nemo2

    for name, v in (("tp", tp), ("pp", pp), ("make_vocab_size_divisible_by", make_vocab_size_divisible_by)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"--{name.replace('_', '-')}={v!r} must be an integer >= 1")
    want = _dtype(dtype)
    if is_nemo2(Path(hf).expanduser()):
        nemo = _with_side_files(_open_nemo2(Path(hf).expanduser(), None), role="NeMo 2 context")
        src, spec, side, reader = nemo.folder, nemo.spec, nemo.side, nemo.reader()
        dtype_of = lambda name, lay: want or nemo.dtype  # noqa: E731
        close = lambda: None  # noqa: E731
    else:
        src = _resolve_hf(hf)
        spec = ModelSpec.from_folder(src)
        reader = SafetensorsReader(src, spec)
        reader.check()
        side = _folder_side_files(src, role="--hf")
        dtype_of = lambda name, lay: want or _source_dtype(reader, name, spec, lay)  # noqa: E731
        close = reader.close
    try:
        check_layout(spec, tp=tp, pp=pp, world=tp * pp)
        layout = Layout(tp=tp, pp=pp, padded_vocab=padded_vocab_size(spec.vocab_size, tp, make_vocab_size_divisible_by))
        plan = []  # (layout of the file, [(local name, shape, dtype)])
        for p in range(pp):
            for t in range(tp):
                lay = layout.at(t, p)
                plan.append((lay, [(n, local_shape(n, spec, lay), dtype_of(n, lay)) for n in local_names(spec, lay)]))
        total = sum(_nbytes(s, d) for _, entries in plan for _, s, d in entries)
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
                            close()  # unmap the source files: their read pages would stay resident
            ckpt.write_layout(root, spec, layout)
            side.write(tmp, want)
    finally:
        close()
    return Path(out)


# ============================================================================ Megatron -> HF
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


def _sources(src: CheckpointSource) -> List[Path]:
    return [src.folder] + ([src.config_source] if src.config_source is not None else [])


def megatron_to_hf(ckpt_path: str | os.PathLike, out: str | os.PathLike, *,
                   hf_config: Optional[str | os.PathLike] = None, dtype: Optional[str] = None,
                   max_shard_bytes: int = DEFAULT_SHARD_BYTES, overwrite: bool = False,
                   progress: bool = True) -> Path:
    """Convert a Megatron checkpoint (any saved TP x PP) or a NeMo 2 checkpoint into the HF
    folder ``out``. ``dtype`` None keeps the stored dtype; config.json says the dtype written."""
    src = _with_side_files(open_checkpoint(ckpt_path, hf_config), role="--hf-config")
    want = _dtype(dtype) or src.dtype
    if want is None:
        raise ConfigError(f"{str(src.folder)!r} stores parameters in several dtypes; pass --dtype")
    if max_shard_bytes < 1:
        raise ConfigError(f"max shard size {max_shard_bytes} must be >= 1 byte")
    files = _plan_hf_files(src.spec, want, max_shard_bytes)
    total = sum(_nbytes(hf_shape(n, src.spec), want) for n in hf_names(src.spec))
    with _staged_output(out, overwrite=overwrite, sources=_sources(src)) as tmp:
        tensors = src.iter_hf(want)
        weight_map: Dict[str, str] = {}
        with _progress(total, f"megatron-to-hf {src.layout}", progress) as bar:
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
        src.side.write(tmp, want)
    return Path(out)


# ============================================================================ -> NeMo 2
def megatron_to_nemo(ckpt_path: str | os.PathLike, out: str | os.PathLike, *, nemo_context: str | os.PathLike,
                     hf_config: Optional[str | os.PathLike] = None, dtype: Optional[str] = None,
                     overwrite: bool = False, progress: bool = True) -> Path:
    """Write a checkpoint (Megatron, any layout, or NeMo 2) as a NeMo 2 checkpoint ``out``:
    ``weights/`` by megatron-core's dist_checkpointing under NeMo's names, ``context/``
    copied from ``nemo_context`` (a NeMo 2 checkpoint of the same model, e.g. the one the
    run started from; NeMo rebuilds the model from it). ``dtype`` None: the context's
    params_dtype, which is what NeMo builds the model in."""
    from nemo_d3s.backends.megatron import nemo2, nemo2_writer

    src = open_checkpoint(ckpt_path, hf_config)
    ctx = Path(nemo_context).expanduser()
    if ctx.name == "context" and (ctx / "model.yaml").is_file():
        ctx = ctx.parent
    if not (ctx / "context" / "model.yaml").is_file():
        raise ConfigError(f"--nemo-context {str(ctx)!r} is not a NeMo 2 checkpoint (no context/model.yaml)")
    cfg = nemo2.hf_config_from_nemo(ctx)
    _same_model(src.spec, ModelSpec.from_hf_dict(cfg), f"{str(src.folder)!r}", f"{str(ctx / 'context')!r}")
    want = _dtype(dtype) or DTYPES[cfg["torch_dtype"]]
    padded = padded_vocab_size(src.spec.vocab_size, 1, nemo2.nemo_make_vocab_size_divisible_by(ctx))
    total = sum(_nbytes(hf_shape(n, src.spec), want) for n in hf_names(src.spec))
    with _staged_output(out, overwrite=overwrite, sources=_sources(src) + [ctx]) as tmp:
        with _progress(total, f"to NeMo 2 from {src.layout}", progress) as bar:
            def counted():
                for name, t in src.iter_hf(want):
                    bar.update(_nbytes(t.shape, want))
                    yield name, t

            nemo2_writer.write_nemo2(counted(), src.spec, tmp, padded_vocab=padded)
        shutil.copytree(ctx / "context", tmp / "context", symlinks=False)
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

    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers 4.x
        from transformers.modeling_utils import no_init_weights

    cfg = src.hf_config()
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    try:
        copy_hf_weights(model, src.iter_hf(), tie_word_embeddings=src.spec.tie_word_embeddings)
    except KeyError as e:
        raise ConfigError(f"the checkpoint does not fit transformers' model: {e.args[0]}") from None
    return model.eval()


def verify(hf: str | os.PathLike, ckpt_path: str | os.PathLike, *, hf_config: Optional[str | os.PathLike] = None,
           atol: float = 1e-4, dtype: str = "float32", prompts: Sequence[str] = VERIFY_PROMPTS) -> VerifyResult:
    """Compare the logits of transformers on the HF folder ``hf`` with those of the
    checkpoint converted in memory (config from ``hf_config``, the checkpoint folder, or
    ``hf``), both computed in ``dtype``. One model is in memory at a time."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nemo_d3s.backends.megatron.nemo2 import is_nemo2

    hf_dir = _resolve_hf(hf)
    spec = ModelSpec.from_folder(hf_dir)
    path = Path(ckpt_path).expanduser()
    cfg_dir = hf_config
    if cfg_dir is None and not is_nemo2(path):  # a training checkpoint: the HF folder's config
        folder, _ = _find_root(path)
        cfg_dir = folder if (folder / "config.json").is_file() else hf_dir
    src = open_checkpoint(path, cfg_dir)
    _same_model(spec, src.spec, f"{str(hf_dir)!r}", f"{str(src.folder)!r}")
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
                        layout=src.layout)
