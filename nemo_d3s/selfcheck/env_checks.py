"""``env.versions`` reports the library versions and fails only when megatron-core or
transformers do not import; ``env.gpus`` (CUDA) reports each GPU and fails under 1 GB free.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import platform
from typing import Any, Dict, Optional

import torch

from nemo_d3s.selfcheck.base import Check, Context
from nemo_d3s.selfcheck.report import CheckFailed

__all__ = ["CHECKS", "versions"]

# (distribution name on PyPI, import name) of what a GPU job uses.
_PACKAGES = (
    ("megatron-core", "megatron.core"),
    ("transformers", "transformers"),
    ("transformer-engine", "transformer_engine"),
    ("apex", "apex"),
    ("vllm", "vllm"),
    ("nemo_d3s", "nemo_d3s"),
)


def _dist_version(dist_name: str, module: str) -> Optional[str]:
    for name in (dist_name, dist_name.replace("-", "_"), module.split(".")[0]):
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            continue
    return None


def versions() -> Dict[str, Any]:
    """{package: version or "not installed" / "broken: <error>"}, plus python, torch, CUDA
    (torch's build), NCCL (torch's bundled one, CUDA builds only)."""
    out: Dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_build": torch.version.cuda or "none",
    }
    if torch.cuda.is_available():
        try:
            # (major, minor, patch[, suffix]): torch 2.13 torch/cuda/nccl.py:35-53
            out["nccl"] = ".".join(str(x) for x in torch.cuda.nccl.version())
        except Exception as e:  # a build without NCCL
            out["nccl"] = f"unavailable ({type(e).__name__})"
    for dist_name, module in _PACKAGES:
        version = _dist_version(dist_name, module)
        if version is None:
            out[dist_name] = "not installed"
            continue
        if dist_name in ("vllm", "transformer-engine"):
            out[dist_name] = (
                version  # importing them costs seconds (and CUDA for TE): the TE check imports it
            )
            continue
        try:
            importlib.import_module(module)
            out[dist_name] = version
        except Exception as e:
            out[dist_name] = f"broken: {type(e).__name__}: {e}"[:120]
    return out


def check_versions(ctx: Context) -> Dict[str, Any]:
    v = versions()
    bad = {k: v[k] for k in ("megatron-core", "transformers") if not str(v[k])[:1].isdigit()}
    if bad:
        raise CheckFailed(f"required packages do not import: {bad}", v)
    return v


def check_gpus(ctx: Context) -> Dict[str, Any]:
    n = torch.cuda.device_count()
    out: Dict[str, Any] = {"visible_gpus": n, "rank_device": str(ctx.device)}
    for i in range(n):
        p = torch.cuda.get_device_properties(i)
        out[f"gpu{i}"] = f"{p.name} {p.total_memory / 2**30:.1f} GiB sm_{p.major}{p.minor}"
    free, total = torch.cuda.mem_get_info(ctx.device)
    out.update(free_gib=free / 2**30, total_gib=total / 2**30)
    if free < 2**30:
        raise CheckFailed(
            f"{ctx.device} has {free / 2**30:.2f} GiB free (another process holds it?)", out
        )
    return out


CHECKS = [
    Check("env.versions", False, check_versions),
    Check("env.gpus", True, check_gpus),
]
