"""Pickles a checkpoint holds, read without running them: every class the pickle names is
either one of a few harmless real types (``torch.Size``, dtypes, ``OrderedDict``, ``set``)
or rebuilt as an inert :class:`Record` that only stores what it is given; nothing is
imported, no callable from the file is ever called.

Two readers share it: ``nemo2._MetadataUnpickler`` (torch DCP's ``.metadata`` index of NeMo 2
and Megatron-LM / Megatron-Bridge checkpoints, which also refuses every class outside DCP's
and megatron-core's metadata records) and :func:`read_common_pt` (megatron-core's
``common.pt``: the non-sharded part of a ``dist_checkpointing`` save, where Megatron-LM keeps
its ``args`` namespace; a ``torch.save`` zip whose tensors are not read).
"""

from __future__ import annotations

import collections
import pickle
import zipfile
from pathlib import Path
from typing import Any, Dict

import torch

from nemo_d3s.errors import ConfigError

__all__ = ["Record", "DTYPE_NAMES", "real_class", "read_common_pt"]

DTYPE_NAMES = (
    "float32",
    "bfloat16",
    "float16",
    "float64",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint8",
    "bool",
)


class Record:
    """Stand-in for a pickled object: keeps the attributes, runs no code."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args
        self.__dict__.update(kwargs)

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2:  # (dict, slots)
            state = {**(state[0] or {}), **(state[1] or {})}
        if isinstance(state, dict):
            self.__dict__.update(state)


def real_class(module: str, name: str) -> Any:
    """The harmless real objects both readers build: None when ``module.name`` is not one."""
    if module == "torch" and name == "Size":
        return torch.Size
    if module == "torch" and name in DTYPE_NAMES:
        return getattr(torch, name)
    if (module, name) == ("collections", "OrderedDict"):
        return collections.OrderedDict
    if module == "builtins" and name in ("set", "frozenset"):
        return {"set": set, "frozenset": frozenset}[name]
    return None


class _TensorStub(Record):
    """A tensor of ``common.pt`` (its bytes are not read: nothing here needs them)."""


def _tensor_stub(*args: Any, **kwargs: Any) -> _TensorStub:
    return _TensorStub()


# Module prefixes whose classes common.pt may name (Megatron-LM's args: argparse.Namespace
# with torch dtypes and megatron / TE enums; the optimizer's and scheduler's plain state):
# each becomes an inert Record. Anything else (os, subprocess, builtins.eval, ...) is refused.
_COMMON_MODULES = ("argparse", "enum", "pathlib", "types")
_COMMON_PACKAGES = ("megatron.", "transformer_engine.")


class _CommonUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        real = real_class(module, name)
        if real is not None:
            return real
        if module == "torch._utils" and name.startswith("_rebuild_"):
            return _tensor_stub
        if module == "torch" and name.endswith("Storage"):
            return type(name, (Record,), {})
        if module in _COMMON_MODULES or module.startswith(_COMMON_PACKAGES):
            return type(name, (Record,), {"__module__": "nemo_d3s.record." + module})
        raise pickle.UnpicklingError(f"refusing to unpickle {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:  # a tensor's storage: not read
        return None


def read_common_pt(path: Path) -> Dict[str, Any]:
    """The dict megatron-core's ``dist_checkpointing.save`` wrote to ``common.pt``
    (``torch.save``'s zip: ``<name>/data.pkl`` plus tensor storages) through
    :class:`_CommonUnpickler`: argparse namespaces and enums come back as :class:`Record`
    (``vars(record)`` holds the fields), tensors as stubs. ConfigError naming the file for
    anything else (the legacy non-zip format, a class outside the allow-list, garbage)."""
    try:
        with zipfile.ZipFile(path) as z:
            pkl = [n for n in z.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
            if len(pkl) != 1:
                raise ValueError("no single data.pkl in the archive")
            with z.open(pkl[0]) as f:
                data = _CommonUnpickler(f).load()
    except (OSError, EOFError, zipfile.BadZipFile, pickle.UnpicklingError, ValueError) as e:
        raise ConfigError(
            f"{str(path)!r}: not a readable megatron-core common.pt ({e}); pass --hf-config DIR "
            "(the model's HF folder) to convert without it"
        ) from None
    except Exception as e:  # a malformed pickle can raise almost anything from the VM
        raise ConfigError(f"{str(path)!r}: not a readable megatron-core common.pt ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{str(path)!r} holds {type(data).__name__}, not a dict")
    return data
