"""torch DCP's index of a torch_dist folder, read without running pickled code: ``.metadata``
through a restricted unpickler, then each tensor chunk's and byte item's shape, dtype and
byte range in ``__*.distcp`` (:class:`DcpIndex`). Imports no other ``formats`` module.
"""

from __future__ import annotations

import io
import json
import math
import pickle
from pathlib import Path
from typing import Any, Dict, List, Tuple

import torch

from nemo_d3s.errors import ConfigError
from nemo_d3s.formats.pickle_records import DTYPE_NAMES, Record

__all__ = ["DcpIndex"]


# ============================================================================ weights/.metadata
class _TensorProperties(Record):
    """DCP pickles TensorProperties as a 5-tuple up to torch 2.14 (torch 2.13:
    torch/distributed/checkpoint/metadata.py:57-75) and a 6-tuple with ``strides`` from torch 2.15
    (metadata.py:57, :59-78, :80-101); both are read, only the dtype is used.
    """

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) in (5, 6):
            self.dtype = state[0]
            self.strides = state[5] if len(state) == 6 else None
            if self.strides is not None and not (
                isinstance(self.strides, tuple) and all(type(x) is int for x in self.strides)
            ):
                raise ValueError(f"TensorProperties strides {self.strides!r} are not ints")
        elif isinstance(state, tuple) and len(state) != 2:
            raise ValueError(f"TensorProperties of {len(state)} items (torch reads 5 or 6)")
        else:
            super().__setstate__(state)


class _MetadataUnpickler(pickle.Unpickler):
    """DCP ``.metadata`` building only torch.Size, dtypes, layouts and the DCP / megatron metadata
    dataclasses (as :class:`Record`); anything else is refused.
    """

    _RECORDS = {
        "torch.distributed.checkpoint.metadata": {
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
        },
        "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
        "torch.distributed.checkpoint.planner": {"TensorWriteData", "WriteItem", "SavePlan"},
        "megatron.core.dist_checkpointing.strategies.torch": {"MCoreMetadata", "MCoreSavePlan"},
        # StorageMeta.checkpoint_id: torch's FileSystemWriter records the folder as a Path
        "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
        "pathlib._local": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    }

    def __init__(self, f, path: Path) -> None:
        super().__init__(f)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch.distributed.checkpoint.metadata", "TensorProperties"):
            return _TensorProperties
        if name in self._RECORDS.get(module, ()):
            return type(name, (Record,), {})
        if module == "torch" and name == "Size":
            return torch.Size
        if module == "torch" and name in DTYPE_NAMES:
            return getattr(torch, name)
        if (module, name) in (
            ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
            ("torch.distributed.checkpoint.planner", "WriteItemType"),
        ):
            return lambda *a, **k: a[0] if a else None
        if (module, name) == ("torch.serialization", "_get_layout"):
            return lambda n: getattr(torch, str(n).replace("torch.", ""), None)
        if (module, name) == ("collections", "OrderedDict"):
            import collections

            return collections.OrderedDict
        raise pickle.UnpicklingError(f"refusing to unpickle {module}.{name}")


class DcpIndex:
    """Global shape, dtype and per-chunk byte ranges of every tensor of a DCP folder."""

    def __init__(self, weights: Path) -> None:
        self.weights = weights
        meta = weights / "metadata.json"
        try:
            backend = json.loads(meta.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConfigError(f"{str(meta)!r} is not valid JSON: {e}") from None
        if not isinstance(backend, dict) or backend.get("sharded_backend") != "torch_dist":
            got = backend.get("sharded_backend") if isinstance(backend, dict) else backend
            raise ConfigError(
                f"{str(meta)!r}: sharded_backend={got!r}; only torch_dist checkpoints are read"
            )
        path = weights / ".metadata"
        try:
            with open(path, "rb") as f:
                md = _MetadataUnpickler(f, path).load()
            sd_meta, storage = md.state_dict_metadata, md.storage_data
            self.tensors: Dict[str, Tuple[Tuple[int, ...], torch.dtype]] = {}
            for fqn, m in sd_meta.items():
                props = getattr(m, "properties", None)
                if props is not None and hasattr(m, "size"):
                    self.tensors[str(fqn)] = (tuple(int(x) for x in m.size), props.dtype)
            self.chunks: Dict[str, List[Tuple[Tuple[int, ...], str, int, int]]] = {}
            self.objects: Dict[str, Tuple[str, int, int]] = {}  # byte items (ShardedObjects)
            for idx, info in storage.items():
                fqn = str(idx.fqn)
                if fqn in self.tensors or type(sd_meta.get(fqn)).__name__ == "BytesStorageMetadata":
                    if getattr(info, "transform_descriptors", None):
                        raise ValueError(
                            f"{fqn}: transformed (compressed) storage is not supported"
                        )
                    rel = str(info.relative_path)
                    if "/" in rel or rel.startswith(".."):
                        raise ValueError(f"{fqn}: storage path {rel!r} points outside weights/")
                    where = (rel, int(info.offset), int(info.length))
                    if fqn not in self.tensors:
                        self.objects[fqn] = where
                        continue
                    offsets = tuple(int(x) for x in (getattr(idx, "offset", None) or ()))
                    self.chunks.setdefault(fqn, []).append((offsets, *where))
        except (
            OSError,
            EOFError,
            pickle.UnpicklingError,
            AttributeError,
            TypeError,
            ValueError,
        ) as e:
            raise ConfigError(
                f"{str(path)!r}: not a readable NeMo 2 / torch_dist index ({e})"
            ) from None

    def read_object(self, fqn: str) -> Tuple[bytes, Path]:
        """The raw bytes of the byte item ``fqn`` (a megatron-core ShardedObject: a
        ``torch.save`` zip, nothing unpickled here) and the file they came from."""
        rel, start, length = self.objects[fqn]
        path = self.weights / rel
        try:
            with open(path, "rb") as f:
                f.seek(start)
                raw = f.read(length)
        except OSError as e:
            raise ConfigError(f"{str(path)!r}: {fqn!r} is unreadable ({e})") from None
        if len(raw) != length:
            raise ConfigError(f"{str(path)!r}: {fqn!r} is cut short ({len(raw)} of {length} B)")
        return raw, path

    def read(self, fqn: str, at: Tuple[int, ...] = ()) -> torch.Tensor:
        """The global tensor ``fqn``, or its slice ``t[at]`` on the leading axes (``(layer,)``
        of a stacked layer tensor, ``(layer, expert)`` of an expert's), assembled from the
        chunks that cover it; each chunk is checked against the index."""
        shape, dtype = self.tensors[fqn]
        if len(at) > len(shape) or any(not 0 <= i < n for i, n in zip(at, shape)):
            raise ConfigError(f"{str(self.weights)!r}: {fqn!r} {list(shape)} has no index {at}")
        want = shape[len(at) :]
        out = torch.empty(want, dtype=dtype)
        # the boxes written so far: a count of elements alone would let overlapping chunks
        # reach the total with parts of ``out`` never written (its uninitialised memory then
        # loaded as weights); boxes, not a mask the tensor's size (a 70B embedding: 1.2 GB)
        placed: List[Tuple[Tuple[int, ...], Tuple[int, ...]]] = []
        for offsets, rel, start, length in self.chunks.get(fqn, []):
            path = self.weights / rel
            try:
                with open(path, "rb") as f:
                    f.seek(start)
                    raw = f.read(length)
                t = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
            except Exception as e:
                raise ConfigError(
                    f"{str(path)!r}: chunk of {fqn!r} at {list(offsets)} is unreadable ({e})"
                ) from None
            if (
                not isinstance(t, torch.Tensor)
                or t.dtype != dtype
                or t.dim() != len(shape)
                or len(offsets) != len(shape)
                or any(o + s > g for o, s, g in zip(offsets, t.shape, shape))
            ):
                raise ConfigError(
                    f"{str(path)!r}: chunk of {fqn!r} at {list(offsets)} does not fit "
                    f"{list(shape)} {dtype}"
                )
            # narrow() counts a negative start from the end: the chunk would land elsewhere
            if any(o < 0 for o in offsets):
                raise ConfigError(
                    f"{str(path)!r}: chunk of {fqn!r} at {list(offsets)} has a negative offset"
                )
            # a chunk may span several layers (or experts): keep it only where it covers ``at``
            if not all(o <= i < o + s for i, o, s in zip(at, offsets, t.shape)):
                continue
            for i, o in zip(at, offsets):
                t = t[i - o]
            box = (tuple(offsets[len(at) :]), tuple(t.shape))
            if any(_boxes_overlap(box, other) for other in placed):
                raise ConfigError(
                    f"{str(path)!r}: chunk of {fqn!r} at {list(offsets)} overlaps another "
                    "chunk of it"
                )
            placed.append(box)
            region = out
            for d, (o, s) in enumerate(zip(*box)):
                region = region.narrow(d, o, s)
            region.copy_(t)
        covered = sum(math.prod(size) for _, size in placed)
        if covered != math.prod(want):
            where = "" if not at else f" at {list(at)}"
            raise ConfigError(
                f"{str(self.weights)!r}: the chunks of {fqn!r}{where} cover {covered} of "
                f"{math.prod(want)} elements"
            )
        return out


def _boxes_overlap(a, b) -> bool:
    """Whether boxes (offsets, sizes) share an element: they overlap on every axis."""
    return all(ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in zip(*a, *b))
