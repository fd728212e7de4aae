"""The cluster's preconditions for a colocated run (CUDA only: facts about GPUs and driver).
``cluster.shared_gpu``: the GPU's compute mode lets the vLLM engine's process share the
trainer's GPU (read from nvidia-smi, then proved by a child allocating 1 MiB there).
``cluster.driver``: the driver's CUDA version (``cuDriverGetVersion``) against
``torch.version.cuda``: an older major fails, an older minor is a note. The decisions are
pure functions, tested on CPU.
"""

from __future__ import annotations

import ctypes
import subprocess
import sys
from typing import Any, Dict, Optional, Tuple

from nemo_d3s.selfcheck.base import Check, Context
from nemo_d3s.selfcheck.report import CheckFailed

__all__ = ["CHECKS", "compute_mode_problem", "driver_problem", "cuda_version"]

SHARED_MODES = ("default",)  # nvidia-smi's names; Exclusive_Process / Prohibited refuse a 2nd


def compute_mode_problem(mode: str) -> Optional[str]:
    """None when a GPU in compute mode ``mode`` (nvidia-smi's name) takes a second process's
    CUDA context; else why not."""
    if mode.strip().lower() in SHARED_MODES:
        return None
    return (
        f"compute mode {mode.strip()}: the vLLM engine's process cannot open the GPU beside the "
        "trainer (ask the admins for Default mode, e.g. a Slurm --gres flag or nvidia-smi -c 0)"
    )


def cuda_version(v: int) -> Tuple[int, int]:
    """``cuDriverGetVersion``'s 1000 major + 10 minor -> (major, minor)."""
    return v // 1000, (v % 1000) // 10


def driver_problem(driver: int, runtime: str) -> Tuple[Optional[str], Optional[str]]:
    """(failure, note) for driver CUDA ``driver`` (``cuDriverGetVersion``) and torch's ``runtime``
    ("12.8"): an older major fails, an older minor of the same major is a note.
    """
    want = tuple(int(x) for x in runtime.split(".")[:2])
    have = cuda_version(driver)
    if have[0] < want[0]:
        return (
            f"the driver runs CUDA {have[0]}.{have[1]}, torch needs CUDA {runtime}: update the "
            "driver or use a container built for the driver's CUDA",
            None,
        )
    if have < want:
        return None, (
            f"driver CUDA {have[0]}.{have[1]} < torch's {runtime}: runs under minor-version "
            "compatibility (PTX needing the newer JIT fails; cuda-compat lifts it)"
        )
    return None, None


def _bus_id(device) -> Optional[str]:
    import torch

    p = torch.cuda.get_device_properties(device)
    if not hasattr(p, "pci_bus_id"):
        return None
    return f"{p.pci_domain_id:08X}:{p.pci_bus_id:02X}:{p.pci_device_id:02X}.0"


def _modes() -> Dict[str, str]:
    """{PCI bus id: compute mode} from nvidia-smi ({} when it is not there)."""
    try:
        text = subprocess.run(
            ["nvidia-smi", "--query-gpu=pci.bus_id,compute_mode", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    rows = [line.split(",") for line in text.splitlines() if "," in line]
    return {bus.strip().upper(): mode.strip() for bus, mode in rows}


_SECOND_PROCESS = (
    "import sys, torch; torch.cuda.set_device(int(sys.argv[1])); "
    "x = torch.ones(2**18, device='cuda'); torch.cuda.synchronize(); print(float(x.sum()))"
)


def check_shared_gpu(ctx: Context) -> Dict[str, Any]:
    import torch

    torch.ones(1, device=ctx.device)  # this process holds its context while the child starts
    out: Dict[str, Any] = {"device": str(ctx.device)}
    modes, bus = _modes(), _bus_id(ctx.device)
    mode = modes.get(bus or "", None)
    out["compute_mode"] = mode if mode is not None else f"unknown ({len(modes)} GPUs listed)"
    problems = [p for p in [compute_mode_problem(mode) if mode else None] if p]
    child = subprocess.run(
        [sys.executable, "-c", _SECOND_PROCESS, str(ctx.device.index or 0)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    out["second_process"] = "ok" if child.returncode == 0 else f"exit {child.returncode}"
    if child.returncode != 0:
        tail = (child.stderr or child.stdout).strip().splitlines()[-1:] or [""]
        problems.append(f"a second process could not use {ctx.device}: {tail[0][:200]}")
    if problems:
        raise CheckFailed("; ".join(problems), out)
    return out


def _driver_version() -> int:
    lib = ctypes.CDLL("libcuda.so.1")
    v = ctypes.c_int(0)
    rc = lib.cuDriverGetVersion(ctypes.byref(v))
    if rc != 0:
        raise CheckFailed(f"cuDriverGetVersion returned {rc}")
    return int(v.value)


def check_driver(ctx: Context) -> Dict[str, Any]:
    import torch

    runtime = str(torch.version.cuda)
    driver = _driver_version()
    major, minor = cuda_version(driver)
    out: Dict[str, Any] = {"driver_cuda": f"{major}.{minor}", "torch_cuda": runtime}
    failure, note = driver_problem(driver, runtime)
    if note:
        out["note"] = note
    if failure:
        raise CheckFailed(failure, out)
    return out


CHECKS = [
    Check(
        "cluster.shared_gpu",
        True,
        check_shared_gpu,
        "the GPU's compute mode lets a second process (the vLLM engine) open it beside the "
        "trainer: nvidia-smi's mode, and a child process allocating on this rank's GPU",
    ),
    Check(
        "cluster.driver",
        True,
        check_driver,
        "the driver's CUDA version (cuDriverGetVersion) is at least the CUDA torch was built with",
    ),
]
