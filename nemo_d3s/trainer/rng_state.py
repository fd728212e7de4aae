"""A process's random number generators as tensors and plain numbers, and the one loader of
checkpoint files: ``torch.load(weights_only=True)``, nothing pickled runs."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Dict

import numpy as np
import torch

from nemo_d3s.trainer.faults import RunError, first_line

__all__ = ["capture_rng", "restore_rng", "safe_load"]

_RNG_FORMAT = 2


def capture_rng() -> Dict[str, Any]:
    """This process's generator states as tensors and plain numbers (loadable with
    ``torch.load(weights_only=True)``)."""
    py_version, py_state, py_gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_cached = np.random.get_state()
    state: Dict[str, Any] = {
        "format": _RNG_FORMAT,
        "python": {
            "version": int(py_version),
            "state": torch.tensor(py_state, dtype=torch.int64),
            "gauss_next": None if py_gauss is None else float(py_gauss),
        },
        "numpy": {
            "name": str(np_name),
            "keys": torch.from_numpy(np.asarray(np_keys, dtype=np.int64)),
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "cached_gaussian": float(np_cached),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    return state


def restore_rng(state: Dict[str, Any]) -> None:
    """Set this process's generators to ``state`` (:func:`capture_rng`'s); ValueError for a
    state of another format."""
    if not isinstance(state, dict) or state.get("format") != _RNG_FORMAT:
        raise ValueError("RNG state in an unknown format (written by another version?)")
    py = state["python"]
    random.setstate(
        (int(py["version"]), tuple(int(x) for x in py["state"].tolist()), py["gauss_next"])
    )
    npy = state["numpy"]
    np.random.set_state(
        (
            npy["name"],
            npy["keys"].numpy().astype(np.uint32),
            int(npy["pos"]),
            int(npy["has_gauss"]),
            float(npy["cached_gaussian"]),
        )
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def safe_load(path: Path) -> Any:
    """``torch.load`` of an untrusted file: tensors and plain containers only. Anything else
    (a pickled object, a code payload) is refused with a RunError naming the file."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # UnpicklingError, a truncated zip, ...
        raise RunError(
            f"refusing to load {str(path)!r}: not a plain tensor file ({first_line(e)})"
        ) from None
