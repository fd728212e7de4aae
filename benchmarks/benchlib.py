"""Shared helpers for the benchmarks: rank launcher, timers, memory probes, collective
byte counter, machine info, JSON output.

Nothing here is imported by the package; benchmarks import it as a sibling module
(``python benchmarks/NAME.py`` puts this folder first on ``sys.path``, and the spawned
ranks inherit that path).

Measuring on a shared, noisy 2-core machine
-------------------------------------------
Absolute times drift by tens of percent between minutes, so every benchmark interleaves
the repetitions of the methods it compares (round-robin, rotating the order each round),
reports medians, and draws its conclusions from ratios taken inside one run.

Memory. torch's CPU allocator keeps no statistics (``torch.cuda.max_memory_allocated``
has no CPU counterpart), and ``tracemalloc`` does not see torch's buffers. Two probes:

- ``TorchAllocPeak``: the torch profiler with ``profile_memory=True`` records every
  allocation and free made through torch's CPU allocator on the calling thread; the peak
  of their running sum is the extra memory that torch allocated during the call (outputs
  that survive the call included, inputs allocated earlier excluded). Exact in bytes, but
  blind to memory not allocated by torch (e.g. gloo's internal staging buffers).
- ``RssPeak``: the OS view. ``/proc/self/clear_refs`` <- "5" resets the peak resident set
  size (VmHWM); after the call, VmHWM - VmRSS(before) is how far resident memory rose.
  ``limit_malloc_caching()`` makes glibc mmap every allocation >= 64 KiB and return it on
  free, so freed tensors do not stay resident and a later allocation really raises RSS.
  It sees everything (gloo included) but counts pages touched by any thread of the process.
"""

from __future__ import annotations

import ctypes
import datetime as _dt
import json
import multiprocessing
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
RESULTS_DIR = os.path.join(HERE, "results")


# ---------------------------------------------------------------------------- machine info


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _mem_total_bytes() -> Optional[int]:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _git_state() -> Dict[str, Any]:
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        return {"commit": head or None, "dirty": bool(dirty)}
    except Exception:  # not a git checkout, or git missing
        return {"commit": None, "dirty": None}


def machine_info() -> Dict[str, Any]:
    import torch

    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    try:  # the distribution's metadata: importing megatron.core costs seconds
        from importlib.metadata import version

        megatron_version = version("megatron-core")
    except Exception:
        megatron_version = None
    return {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "megatron_core": megatron_version,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": usable,
        "mem_total_bytes": _mem_total_bytes(),
        "cuda_available": bool(torch.cuda.is_available()),
        "git": _git_state(),
        "argv": sys.argv,
    }


# ---------------------------------------------------------------------------- output


def results_dir(quick: bool = False) -> str:
    """benchmarks/results, or benchmarks/results/quick for --quick smoke runs (so a smoke
    run never overwrites the full results)."""
    d = os.path.join(RESULTS_DIR, "quick") if quick else RESULTS_DIR
    os.makedirs(d, exist_ok=True)
    return d


def write_json(name: str, data: Dict[str, Any], quick: bool = False) -> str:
    path = os.path.join(results_dir(quick), f"{name}.json")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2, sort_keys=False, default=str)
        f.write("\n")
    os.replace(tmp, path)
    return path


def png_path(name: str, quick: bool = False) -> str:
    return os.path.join(results_dir(quick), f"{name}.png")


def median(xs: Iterable[float]) -> float:
    xs = [x for x in xs if x is not None]
    return float(statistics.median(xs)) if xs else float("nan")


def fmt_bytes(n: Optional[float]) -> str:
    if n is None or n != n:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for j, r in enumerate(cells):
        lines.append(
            "  ".join(
                c.rjust(w) if j and i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))
            )
        )
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    text = "\n".join(lines)
    print(text, flush=True)
    return text


# ---------------------------------------------------------------------------- memory probes

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def limit_malloc_caching(mmap_threshold: int = 64 * 1024) -> bool:
    """glibc: serve allocations >= ``mmap_threshold`` with mmap (returned to the OS on
    free) and trim the heap eagerly, so RSS follows live memory. False if unavailable."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, int(mmap_threshold)) == 1
        ok &= libc.mallopt(_M_TRIM_THRESHOLD, 0) == 1
        return bool(ok)
    except OSError:
        return False


def _proc_status() -> Dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, val = line.split(":", 1)
                out[key] = int(val.split()[0]) * 1024
    return out


class RssPeak:
    """``with RssPeak() as p: ...`` -> ``p.delta``: peak RSS during the block minus RSS
    at its start (bytes). ``p.ok`` is False when the peak could not be reset."""

    def __enter__(self):
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.ok = True
        except OSError:
            self.ok = False
        self.before = _proc_status()["VmRSS"]
        return self

    def __exit__(self, *exc):
        st = _proc_status()
        self.delta = max(0, st["VmHWM"] - self.before) if self.ok else None
        self.after = st["VmRSS"] - self.before
        return False


class TorchAllocPeak:
    """``with TorchAllocPeak() as p: ...`` -> ``p.peak``: peak of the running sum of the
    allocations minus frees made through torch's CPU allocator on this thread inside the
    block (bytes), from the profiler's memory events; ``p.net``: what is still allocated
    at the end. Slows the block down a little: do not time it."""

    def __enter__(self):
        from torch.profiler import ProfilerActivity, profile

        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._prof.__enter__()
        return self

    def __exit__(self, *exc):
        # the profiler's event kinds have no public name
        import torch._C._profiler as P  # noqa: PLC2701

        self._prof.__exit__(*exc)
        sizes = []

        def walk(nodes):
            for n in nodes:
                if n.tag == P._EventType.Allocation:
                    sizes.append((n.start_time_ns, int(n.extra_fields.alloc_size)))
                walk(n.children)

        walk(self._prof.profiler.kineto_results.experimental_event_tree())
        sizes.sort()
        run = peak = 0
        for _, s in sizes:
            run += s
            peak = max(peak, run)
        self.peak, self.net, self.n_events = peak, run, len(sizes)
        return False


# -------------------------------------------------------------------------- collective byte counter

_COUNTED = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "broadcast",
    "all_to_all_single",
    "all_gather_object",
    "reduce_scatter_tensor",
)


class CollectiveCounter:
    """Wraps ``torch.distributed`` collectives while active and records, per call, the
    payload this rank receives: all_reduce / broadcast: the tensor's bytes; all_gather:
    the bytes of all output tensors (world x input); all_to_all_single: the output's
    bytes; all_gather_object: the pickled sizes are not visible, recorded as -1.

    The package calls collectives as ``dist.<name>`` on the ``torch.distributed`` module, so
    replacing the module attributes catches every call."""

    def __init__(self):
        self.calls: List[Dict[str, Any]] = []

    def _wrap(self, name, fn):
        def nbytes(t):
            return t.numel() * t.element_size()

        def wrapper(*args, **kwargs):
            if name in ("all_reduce", "broadcast"):
                b = nbytes(args[0] if args else kwargs["tensor"])
            elif name == "all_gather":
                outs = args[0] if args else kwargs["tensor_list"]
                b = sum(nbytes(t) for t in outs)
            elif name in ("all_gather_into_tensor", "all_to_all_single", "reduce_scatter_tensor"):
                b = nbytes(
                    args[0]
                    if args
                    else kwargs["output_tensor" if name != "all_to_all_single" else "output"]
                )
            else:
                b = -1
            self.calls.append({"op": name, "bytes": int(b)})
            return fn(*args, **kwargs)

        return wrapper

    def __enter__(self):
        import torch.distributed as dist

        self._saved = {n: getattr(dist, n) for n in _COUNTED if hasattr(dist, n)}
        for n, fn in self._saved.items():
            setattr(dist, n, self._wrap(n, fn))
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist

        for n, fn in self._saved.items():
            setattr(dist, n, fn)
        return False

    @property
    def total_bytes(self) -> int:
        return sum(c["bytes"] for c in self.calls if c["bytes"] > 0)

    def summary(self) -> Dict[str, Any]:
        by_op: Dict[str, Dict[str, int]] = {}
        for c in self.calls:
            d = by_op.setdefault(c["op"], {"calls": 0, "bytes": 0})
            d["calls"] += 1
            d["bytes"] += max(0, c["bytes"])
        return {"total_bytes": self.total_bytes, "n_calls": len(self.calls), "by_op": by_op}


# ---------------------------------------------------------------------------- timing


def barrier(group=None) -> None:
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.barrier(group=group)


def max_over_ranks(x: float, group=None) -> float:
    """The largest value of ``x`` over the ranks (a step is as slow as its slowest rank)."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return float(x)
    t = torch.tensor([float(x)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t)


def max_over_ranks_vec(xs: Sequence[float], group=None) -> List[float]:
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(x) for x in xs], dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


@contextmanager
def timed(store: Dict[str, float], key: str):
    t0 = time.perf_counter()
    try:
        yield
    finally:
        store[key] = store.get(key, 0.0) + time.perf_counter() - t0


def rotate(items: Sequence[Any], r: int) -> List[Any]:
    """``items`` rotated by ``r``: interleaved rounds do not always run a method first."""
    items = list(items)
    if not items:
        return items
    r %= len(items)
    return items[r:] + items[:r]


def grpo_batch(B: int, S: int, prompt: int, vocab_ids: int):
    """(TokenBatch [B, S], advantages [B], old-log-prob noise [B, S], token keep [B, S]): row i
    is S - (7 i mod min(50, S - prompt)) tokens long, a ``prompt``-token prompt then the
    response, random ids below ``vocab_ids``; every response token kept."""
    import torch

    from nemo_d3s.backends.base import TokenBatch

    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([S - (7 * i) % min(50, S - prompt) for i in range(B)])
    pos = torch.arange(S)
    attn = pos < lengths.unsqueeze(1)
    resp = attn & (pos >= prompt)
    ids = torch.randint(0, vocab_ids, (B, S), generator=g) * attn
    adv = torch.randn(B, generator=g)
    noise = 0.01 * torch.randn(B, S, generator=g)
    return TokenBatch(ids, attn, resp), adv, noise, resp.clone()


# ---------------------------------------------------------------------------- rank launcher


def _bench_rank_setup(rank: int, megatron_sizes: Optional[tuple]):
    """Per-rank set-up: glibc returns freed blocks (for the RSS probe); Megatron's groups
    when asked. Returns the teardown."""
    limit_malloc_caching()
    if megatron_sizes is None:
        return None
    from nemo_d3s.backends.megatron.parallel import initialize_megatron_groups

    return initialize_megatron_groups(rank, *megatron_sizes)


def run_ranks(
    fn: Callable,
    world: int,
    *args: Any,
    threads: int = 1,
    megatron_sizes: Optional[tuple] = None,
    timeout: float = 600.0,
) -> List[Any]:
    """Run ``fn(rank, *args)`` on ``world`` gloo ranks (CPU), each with ``threads`` torch
    threads; return every rank's result (plain data: tensors, numbers, strings, containers),
    rank order. ``fn`` must be a module-level function; it is loaded in the ranks from its
    file. ``megatron_sizes`` = (tp, pp, cp) initialises Megatron's parallel state first. A failing
    rank fails the call (its traceback is re-raised) and the other ranks are killed
    (``nemo_d3s.distributed.run_on_gloo_ranks``)."""
    from nemo_d3s.distributed.launch import run_on_gloo_ranks

    return run_on_gloo_ranks(
        fn,
        world,
        *args,
        rank_setup=_bench_rank_setup,
        setup_args=(megatron_sizes,),
        threads=threads,
        timeout=timeout,
    )


def set_preload(modules: Sequence[str]) -> None:
    """Import ``modules`` once in the fork server, so ranks fork with them loaded (call
    before the first ``run_ranks``)."""
    # The fork server is a fresh interpreter: silence megatron-core's CPU-only import
    # warning there through the environment (filters set here would not reach it).
    quiet = "ignore:Transformer Engine and Apex are not installed:UserWarning"
    if quiet not in os.environ.get("PYTHONWARNINGS", ""):
        os.environ["PYTHONWARNINGS"] = ",".join(
            x for x in (os.environ.get("PYTHONWARNINGS"), quiet) if x
        )
    try:
        multiprocessing.set_forkserver_preload(list(modules))
    except Exception:  # only an optimisation
        traceback.print_exc()


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def threads_per_rank(world: int) -> int:
    return max(1, cores() // world)


def oversubscription_note(world: int) -> Optional[str]:
    c = cores()
    if world > c:
        return (
            f"{world} ranks on {c} CPU cores: oversubscribed {world / c:.1f}x (1 thread per rank); "
            "ranks time-share cores, so wall times include waiting for descheduled peers"
        )
    return None
