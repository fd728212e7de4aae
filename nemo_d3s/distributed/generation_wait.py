"""Waiting for other ranks' generations without one blocking collective.

A collective limited by the groups' timeout (``trainer.dist_timeout_minutes``) fails on one
long generation (15k new tokens x 128 rollouts per engine at 70B: over an hour); a timeout
that long would leave a dead engine unnoticed as long. Instead, on the job's key-value store
(no tensor, no collective): a generating rank beats (a thread adds to a counter every
``beat_s`` while its engine lives); every member arrives once per generation with its
outcome (stop pending, interrupted, failed); a member polls until all arrived and gives up
(:class:`GenerationTimeout`) after ``base_s`` without an arrival or a beat (the group's
timeout: the members still generating are stopped or dead) or after ``limit_s`` in all
(:func:`generation_limit_s`). Every member learns every member's outcome; one process waits
for nobody; the last arrival removes the previous generation's keys.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch.distributed as dist

from nemo_d3s.distributed.timeouts import group_timeout

__all__ = ["MIN_TOKENS_PER_S", "GenerationTimeout", "GenerationWait", "Outcome"]

# The slowest aggregate decode rate (new tokens per second over a generation's rows) a live
# engine is assumed to keep; a generation slower than this counts as hung. An assumption, not
# a measurement: about 5x under what the 70B long recipe needs to finish 128 rollouts of 15k
# tokens in the 77 minutes its 23 concurrent sequences at ~20 decode steps/s would take.
MIN_TOKENS_PER_S = 80.0
_STOPPING, _INTERRUPTED, _FAILED = 1, 1 << 20, 1 << 40  # flag fields (members < 2**20)


def generation_limit_s(base_s: float, rows: int, max_new_tokens: int) -> float:
    """How long a wait may last in all: ``base_s`` plus ``rows`` x ``max_new_tokens`` new
    tokens at :data:`MIN_TOKENS_PER_S`."""
    return float(base_s) + float(rows) * float(max_new_tokens) / MIN_TOKENS_PER_S


class GenerationTimeout(RuntimeError):
    """A wait for a generation gave up: a member stopped answering, or never finished."""


@dataclass(frozen=True)
class Outcome:
    """Every member's outcome, summed: ``stopping`` (some member had a stop signal pending),
    ``interrupted`` (some member's generation was cut short), ``failed`` (members whose
    generation raised)."""

    stopping: bool = False
    interrupted: bool = False
    failed: int = 0

    @classmethod
    def of(cls, flags: int) -> "Outcome":
        """The outcome a flags sum encodes (``_STOPPING`` + ``_INTERRUPTED`` + ``_FAILED``)."""
        return cls(
            stopping=bool(flags % _INTERRUPTED),
            interrupted=bool((flags // _INTERRUPTED) % (_FAILED // _INTERRUPTED)),
            failed=int(flags // _FAILED),
        )


class GenerationWait:
    """The wait of ``members`` processes (this one is member ``rank``) for their generations;
    ``name`` tells groups apart on the store, ``base_s`` is the group's timeout in seconds.
    Every member must create it at the same point and call :meth:`agree` the same number of
    times. ``store`` None: one process."""

    def __init__(
        self, name: str, members: int, rank: int, base_s: float, store: Optional[Any] = None
    ) -> None:
        self.name, self.members, self.rank, self.base_s = name, int(members), rank, float(base_s)
        self.store = store if self.members > 1 else None
        self.beat_s = min(5.0, self.base_s / 4)
        self._seq, self._beat_store = 0, None
        if self.store is not None:
            # the n-th wait of this name that this member creates is the n-th of every member
            n = self.store.add(f"nemo_d3s/wait/{name}/instances/{rank}", 1)
            self.prefix = f"nemo_d3s/wait/{name}/{n}"

    @classmethod
    def of_group(
        cls, name: str, group: Optional[Any], base_s: Optional[float] = None
    ) -> "GenerationWait":
        """The wait of the members of ``group`` (None: the world; one process: no store);
        ``base_s`` None: the group's own collective timeout (the longest of its backends')."""
        if not (dist.is_available() and dist.is_initialized()):
            return cls(name, 1, 0, 0.0 if base_s is None else base_s)
        if base_s is None:
            if group is None:
                raise ValueError("GenerationWait.of_group: the world's wait needs base_s")
            base_s = max(t.total_seconds() for t in group_timeout(group).values())
        members = dist.get_world_size(group)
        # torch 2.13 distributed_c10d.py:1433 _get_default_store: the rendezvous' store
        store = dist.distributed_c10d._get_default_store() if members > 1 else None
        return cls(name, members, dist.get_rank(group), base_s, store)

    @contextlib.contextmanager
    def beating(self, alive: Callable[[], bool]) -> Iterator[None]:
        """While inside: this member beats every ``beat_s`` as long as ``alive()`` says so."""
        if self.store is None:
            yield
            return
        if self._beat_store is None:
            self._beat_store = self.store.clone()  # a store client is not shared across threads
        done = threading.Event()
        key = f"{self.prefix}/beat"

        def beat() -> None:
            while True:
                with contextlib.suppress(Exception):  # a failed beat is a missed one
                    if alive():
                        self._beat_store.add(key, 1)
                if done.wait(self.beat_s):
                    return

        thread = threading.Thread(target=beat, name="nemo_d3s-generation-beat", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()

    def agree(self, *, stopping: bool, interrupted: bool, failed: bool, limit_s: float) -> Outcome:
        """Arrive with this member's outcome, wait for every member (see the module
        docstring) and return their sum. Raises GenerationTimeout."""
        flags = (
            _STOPPING * bool(stopping) + _INTERRUPTED * bool(interrupted) + _FAILED * bool(failed)
        )
        if self.store is None:
            return Outcome.of(flags)
        key = f"{self.prefix}/{self._seq}"
        self._seq += 1
        self.store.add(f"{key}/flags", flags)  # before arriving: complete once all arrived
        if self.store.add(f"{key}/arrived", 1) == self.members:
            self.store.set(f"{key}/open", b"1")
            if self._seq > 1:
                before = f"{self.prefix}/{self._seq - 2}"
                for k in ("flags", "arrived", "open"):
                    self.store.delete_key(f"{before}/{k}")
        self._wait_open(key, float(limit_s))
        return Outcome.of(self.store.add(f"{key}/flags", 0))

    def _wait_open(self, key: str, limit_s: float) -> None:
        start = last_sign = time.monotonic()
        seen, pause = None, 0.01
        while not self.store.check([f"{key}/open"]):
            # polled (a blocking store.wait logs a warning per timed-out slice): every 10 ms
            # at first, then less often up to once a second (a long generation's waiters)
            time.sleep(pause)
            pause = min(1.0, pause * 1.5)
            now = time.monotonic()
            signs = (self.store.add(f"{key}/arrived", 0), self.store.add(f"{self.prefix}/beat", 0))
            if signs != seen:
                seen, last_sign = signs, now
            arrived = signs[0]
            if now - last_sign > self.base_s:
                raise GenerationTimeout(
                    f"waiting for a generation ({self.name}) timed out: {self.members - arrived} "
                    f"of {self.members} ranks neither finished nor beat for {self.base_s:.0f} s "
                    "(trainer.dist_timeout_minutes): a rank or its engine is stopped or dead"
                )
            if now - start > limit_s:
                raise GenerationTimeout(
                    f"waiting for a generation ({self.name}) timed out: {self.members - arrived} "
                    f"of {self.members} ranks still generating after {limit_s:.0f} s (the "
                    f"group's timeout + the generation's tokens at {MIN_TOKENS_PER_S:.0f}/s)"
                )
