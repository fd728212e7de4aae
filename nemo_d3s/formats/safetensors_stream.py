"""safetensors files written tensor by tensor (:class:`StreamingSafetensors`), so that a
converter holds one parameter group in memory, not the model; torch only (the file format
is written by hand: 8-byte header length, JSON header, raw little-endian data).
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path
from typing import Any, Dict, Optional, Sequence, Tuple

import torch

__all__ = ["ST_NAME", "nbytes", "StreamingSafetensors"]

# torch dtype -> safetensors' name for it (the parameter dtypes a model folder may hold)
ST_NAME = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    """Bytes of a tensor of ``shape`` and ``dtype``."""
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
            n = nbytes(shape, dtype)
            header[name] = {"dtype": ST_NAME[dtype], "shape": list(shape), "data_offsets": [off, off + n]}
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
