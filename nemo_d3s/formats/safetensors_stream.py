"""safetensors files written tensor by tensor (:class:`StreamingSafetensors`), so a converter
holds one parameter group, not the model, and checked before use (:func:`check_safetensors`:
a truncated or garbled file is one ConfigError naming it). torch only.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import struct
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from nemo_d3s.errors import ConfigError

__all__ = [
    "DEFAULT_SHARD_BYTES",
    "ST_NAME",
    "plan_hf_files",
    "write_hf_weights",
    "nbytes",
    "StreamingSafetensors",
    "check_safetensors",
    "check_safetensors_folder",
]

# The largest safetensors file of a Hugging Face folder we write (transformers' default too).
DEFAULT_SHARD_BYTES = 5 * 2**30

# torch dtype -> safetensors' name for it (the parameter dtypes a model folder may hold)
ST_NAME = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    """Bytes of a tensor of ``shape`` and ``dtype``."""
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


class StreamingSafetensors:
    """One safetensors file written tensor by tensor: the header is planned from (name, shape,
    dtype) entries, each tensor's bytes go to its planned offset, so only the given tensor is
    held. The layout of ``safetensors.torch.save_file`` (8-byte length, JSON header
    padded to 8, larger element types first). A context manager: a normal exit checks every
    planned tensor arrived (else RuntimeError).
    """

    def __init__(
        self,
        path: Path,
        entries: Sequence[Tuple[str, Tuple[int, ...], torch.dtype]],
        metadata: Optional[Dict[str, str]] = None,
    ) -> None:
        self.path = Path(path)
        header: Dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
        order = sorted(entries, key=lambda e: -torch.empty((), dtype=e[2]).element_size())
        self._slots: Dict[str, Tuple[int, Tuple[int, ...], torch.dtype]] = {}
        off = 0
        for name, shape, dtype in order:
            if name in self._slots:
                raise ValueError(f"{name!r} planned twice in {self.path.name}")
            n = nbytes(shape, dtype)
            header[name] = {
                "dtype": ST_NAME[dtype],
                "shape": list(shape),
                "data_offsets": [off, off + n],
            }
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
            raise RuntimeError(
                f"{self.path.name}: tensors never written: {sorted(self._pending)[:3]}"
            )
        if end != self._base + self.nbytes:
            raise RuntimeError(
                f"{self.path.name}: {end} bytes written, {self._base + self.nbytes} planned"
            )


Entry = Tuple[str, Tuple[int, ...], torch.dtype]


def plan_hf_files(
    entries: Sequence[Entry], shard_bytes: int = DEFAULT_SHARD_BYTES
) -> List[Tuple[str, List[Entry]]]:
    """(file name, entries) with ``entries`` in order, files of at most ``shard_bytes`` (a larger
    tensor alone), named as transformers names them.
    """
    if shard_bytes < 1:
        raise ValueError(f"max shard size {shard_bytes} must be >= 1 byte")
    groups: List[List[Entry]] = [[]]
    size = 0
    for e in entries:
        n = nbytes(e[1], e[2])
        if groups[-1] and size + n > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(e)
        size += n
    if len(groups) == 1:
        return [("model.safetensors", groups[0])]
    k = len(groups)
    return [(f"model-{i + 1:05d}-of-{k:05d}.safetensors", g) for i, g in enumerate(groups)]


def write_hf_weights(
    folder: Path,
    tensors: Iterable[Tuple[str, torch.Tensor]],
    entries: Sequence[Entry],
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    on_tensor: Optional[Callable[[torch.Tensor], None]] = None,
) -> Dict[str, str]:
    """An HF folder's safetensors files (+ index when several) in ``folder``, from (name, tensor)
    pairs arriving in any order, one tensor in memory at a time. An unplanned or missing name is
    an error. Returns {name: file}; ``on_tensor`` sees each written tensor.
    """
    files = plan_hf_files(entries, shard_bytes)
    where = {e[0]: fname for fname, group in files for e in group}
    with contextlib.ExitStack() as stack:
        writers = {
            fname: stack.enter_context(StreamingSafetensors(Path(folder) / fname, group))
            for fname, group in files
        }
        for name, t in tensors:
            if name not in where:
                raise ValueError(f"{name!r} is not a tensor of this model's weight table")
            writers[where[name]].write(name, t)
            if on_tensor is not None:
                on_tensor(t)
            del t  # before the next one is produced: one tensor in memory
    if len(files) > 1:
        total = sum(nbytes(e[1], e[2]) for e in entries)
        index = {"metadata": {"total_size": total}, "weight_map": where}
        (Path(folder) / "model.safetensors.index.json").write_text(
            json.dumps(index, indent=2) + "\n"
        )
    return where


# bytes per element of safetensors' dtype names
_ITEM = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U64": 8,
    "U32": 4,
    "U16": 2,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}
_MAX_HEADER = 100 * 2**20  # the safetensors library's own limit


def check_safetensors(path: str | os.PathLike) -> None:
    """ConfigError naming ``path`` and the problem unless its header parses and its byte ranges
    cover the data exactly (no tensor is read).
    """
    path = Path(path)
    where = repr(str(path))
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else None
            raw = f.read(n) if n is not None and n <= min(size - 8, _MAX_HEADER) else b""
    except OSError as e:
        raise ConfigError(f"{where} cannot be read: {e.strerror or e}") from None
    if n is None:
        raise ConfigError(
            f"{where} is truncated or empty: {size} bytes, not even a safetensors header"
        )
    if n > _MAX_HEADER:
        raise ConfigError(
            f"{where} is not a safetensors file: its first 8 bytes announce a header of {n} bytes"
        )
    if n > size - 8:
        raise ConfigError(
            f"{where} is truncated: its header alone needs {n} bytes, the file holds {size} in all "
            "(an interrupted copy or download?)"
        )
    try:
        header = json.loads(raw.decode("utf-8"))
        if not isinstance(header, dict):
            raise ValueError("not a JSON object")
        need = 0
        for name, info in header.items():
            if name == "__metadata__":
                continue
            lo, hi = (int(x) for x in info["data_offsets"])
            item = _ITEM.get(info["dtype"])
            if item is not None and hi - lo != math.prod(int(d) for d in info["shape"]) * item:
                raise ValueError(
                    f"tensor {name!r} has {hi - lo} bytes for shape {info['shape']} {info['dtype']}"
                )
            need = max(need, hi)
    except (UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{where} is not a safetensors file: garbled header ({e})") from None
    have = size - 8 - n
    if need > have:
        raise ConfigError(
            f"{where} is truncated: its tensors need {need} bytes of data, the file holds {have} "
            "(an interrupted copy or download?)"
        )
    if need < have:
        raise ConfigError(
            f"{where} is damaged: {have - need} bytes after its last tensor (written over?)"
        )


def check_safetensors_folder(folder: str | os.PathLike) -> None:
    """:func:`check_safetensors` on every ``*.safetensors`` file of a model folder."""
    for f in sorted(Path(folder).glob("*.safetensors")):
        check_safetensors(f)
