"""Run a function on N gloo ranks on one machine's CPU and bring the results back (tests that
compare N ranks with one process, laptop trials, benchmarks).

Each rank joins a gloo group, runs ``rank_setup(rank, *setup_args)`` (it may return a teardown),
then ``fn(rank, *args)``; results come back through ``torch.load(weights_only=True)``
(no code runs on load). An exception or a timeout in any rank is re-raised in the parent with the
child's traceback and the other ranks are killed. ``fn`` and ``rank_setup`` must be module-level
(loaded from their defining file); start method "forkserver"."""

from __future__ import annotations

import importlib.util
import inspect
import os
import socket
import tempfile
import time
from datetime import timedelta
from typing import Any, Callable, List, Optional, Sequence

__all__ = ["free_port", "run_on_gloo_ranks"]


def free_port() -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ref(fn: Optional[Callable]) -> Optional[tuple]:
    if fn is None:
        return None
    if fn.__name__ == "<lambda>" or "<locals>" in fn.__qualname__:
        raise ValueError(
            f"{fn.__qualname__} must be a module-level function (ranks load it from its file)"
        )
    return inspect.getfile(fn), fn.__name__


def _load(ref: tuple) -> Callable:
    path, name = ref
    spec = importlib.util.spec_from_file_location(f"_nemo_d3s_rank_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


def _child(
    rank, fn_ref, setup_ref, setup_args, world_size, port, threads, out_dir, timeout, args
) -> None:
    import torch
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(int(threads))
    # a client of the parent's store: no rank binds a port the parent picked earlier, which
    # another process may have taken meanwhile (seen under CI: EADDRINUSE at rank 0's bind)
    store = dist.TCPStore(
        "127.0.0.1", port, world_size, is_master=False, timeout=timedelta(seconds=timeout)
    )
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout)
    )
    teardown = None
    try:
        if setup_ref is not None:
            teardown = _load(setup_ref)(rank, *setup_args)
        result = _load(fn_ref)(rank, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        if callable(teardown):
            teardown()
        dist.destroy_process_group()


# gloo's TCP mesh between ranks (a group's creation) can fail on a loaded machine with a peer
# closing the half-open connection (seen once under CI, in a two-rank test's new_group:
# "connectFullMesh ... Connection closed by peer"): before ``fn`` has computed anything, so
# the run is started again, once
_MESH_SETUP_FAILURES = ("connectFullMesh",)


def run_on_gloo_ranks(
    fn: Callable,
    world_size: int,
    *args: Any,
    rank_setup: Optional[Callable] = None,
    setup_args: Sequence[Any] = (),
    threads: int = 1,
    timeout: float = 90.0,
    start_method: str = "forkserver",
) -> List[Any]:
    """``[fn(0, *args), ..., fn(world_size - 1, *args)]`` on gloo ranks. Results: CPU tensors,
    numbers, strings, None and containers of them. threads: torch threads per rank; timeout: seconds
    for the whole run, also the group's collective timeout. A run whose ranks failed to connect
    their gloo mesh (``_MESH_SETUP_FAILURES``) runs once more."""
    try:
        return _run_once(
            fn, world_size, args, rank_setup, setup_args, threads, timeout, start_method
        )
    except Exception as e:
        if not any(m in str(e) for m in _MESH_SETUP_FAILURES):
            raise
        import warnings

        warnings.warn(f"{fn.__name__}: gloo ranks failed to connect, starting them again: {e}")
        return _run_once(
            fn, world_size, args, rank_setup, setup_args, threads, timeout, start_method
        )


def _run_once(fn, world_size, args, rank_setup, setup_args, threads, timeout, start_method):
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as tmp

    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    fn_ref, setup_ref = _ref(fn), _ref(rank_setup)
    # The ranks' store lives here, on a port the OS gives it at the bind (port 0): nothing
    # can take it between choosing and binding, and it outlives every rank's last read.
    store = dist.TCPStore(
        "127.0.0.1",
        0,
        world_size,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=timeout),
    )
    with tempfile.TemporaryDirectory(prefix="nemo_d3s_ranks_") as out_dir:
        ctx = tmp.start_processes(
            _child,
            args=(
                fn_ref,
                setup_ref,
                tuple(setup_args),
                world_size,
                store.port,
                threads,
                out_dir,
                timeout,
                args,
            ),
            nprocs=world_size,
            join=False,
            start_method=start_method,
        )
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=0.5):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{fn.__name__} on {world_size} ranks took over {timeout} s")
        except BaseException:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            raise
        results = []
        for r in range(world_size):
            path = os.path.join(out_dir, f"rank{r}.pt")
            if not os.path.exists(path):
                raise RuntimeError(f"rank {r} exited without a result")
            try:
                results.append(torch.load(path, weights_only=True))
            except Exception as e:
                why = [line.strip() for line in str(e).splitlines() if "Unsupported global" in line]
                raise TypeError(
                    f"{fn.__name__}: rank {r}'s result is not plain data (tensors, "
                    "numbers, strings, None and lists/tuples/dicts of "
                    f"them){': ' + why[0] if why else ''}"
                ) from None
        return results
