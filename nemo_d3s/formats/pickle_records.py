"""Pickles a checkpoint holds, read without running them: a class is one of a few harmless
types (``torch.Size``, dtypes, ``OrderedDict``, ``set``) or an inert :class:`Record`; nothing
is imported or called. Used by ``dcp_index`` and :func:`read_common_pt`.
"""

from __future__ import annotations

import collections
import io
import pickle
import zipfile
from pathlib import Path
from typing import Any, Optional

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


def read_common_pt(path: Path, raw: Optional[bytes] = None, what: str = "common.pt") -> Any:
    """A megatron-core ``torch.save`` zip (``path``, or ``raw``: a DCP byte item) read inertly:
    namespaces and enums as :class:`Record`, tensors as stubs. ConfigError naming ``what`` for a
    non-zip file, a class outside the allow-list or garbage.
    """
    bad = f"{str(path)!r}: not a readable megatron-core {what}"
    try:
        with zipfile.ZipFile(path if raw is None else io.BytesIO(raw)) as z:
            pkl = [n for n in z.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
            if len(pkl) != 1:
                raise ValueError("no single data.pkl in the archive")
            with z.open(pkl[0]) as f:
                return _CommonUnpickler(f).load()
    except (OSError, EOFError, zipfile.BadZipFile, pickle.UnpicklingError, ValueError) as e:
        raise ConfigError(
            f"{bad} ({e}); pass --hf-config DIR (the model's HF folder) to convert without it"
        ) from None
    except Exception as e:  # a malformed pickle can raise almost anything from the VM
        raise ConfigError(f"{bad} ({e})") from None
