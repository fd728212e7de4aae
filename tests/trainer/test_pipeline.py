"""The generation pipeline (trainer/pipeline.py) driven by a stand-in engine: batch t is
generated with weights version max(0, t - k) whatever the engine's timing, one refit per
version, the trainer waits only for what the bound needs, a stop signal waits for no
generation, a failed or stopped worker is an error naming it; the rollouts generated ahead
survive a checkpoint file (trainer/rollout_store.py) and nothing else is read back."""

from __future__ import annotations

import contextlib
import random
import threading
import time

import pytest
import torch

from nemo_d3s.backends.base import GenerationConfig, GenerationInterrupted, RolloutEngine, Rollouts
from nemo_d3s.backends.base import TokenBatch
from nemo_d3s.distributed.groups import ParallelGroups
from nemo_d3s.errors import RunError
from nemo_d3s.trainer.data import PromptBatch
from nemo_d3s.trainer.pipeline import WORKER_NAME, GenerationPipeline
from nemo_d3s.trainer.rollout_store import HeldWeights, held_weights_fit, load_rollouts
from nemo_d3s.trainer.rollout_store import save_held_weights, save_rollouts
from _limits import WAIT_S  # noqa: E402


class _Prompts:
    """``PromptSource``'s interface: step j's one prompt carries j as its seed."""

    lo, hi = 0, 1

    def for_step(self, j):
        return PromptBatch([j], [f"p{j}"], torch.tensor([0]), [j])


class _Policy:
    weights_version = 0


def _rollouts(step: int, version: int, n: int) -> Rollouts:
    ids = torch.tensor([[step, version, 7]] * n)
    resp = torch.tensor([[False, True, True]] * n)
    return Rollouts(
        TokenBatch(ids, torch.ones_like(resp), resp),
        torch.zeros(n, dtype=torch.long),
        [f"v{version} é"] * n,
        torch.ones(n, dtype=torch.bool),
        sampling_logprobs=torch.full((n, 3), -0.5),
    )


class _Engine(RolloutEngine):
    """Holds one weights version (set by ``sync_weights``); ``delay(step)`` seconds per batch;
    ``block``: step -> Event the generation of that step waits for (asking ``check_stop``)."""

    own_weights = True

    def __init__(self, delay=lambda step: 0.0, block=None, fail_at=None, readable=True):
        self.tokenizer = None
        self.own_weights_readable = readable
        self.held, self.refits, self.delay = 0, [], delay
        self.block, self.fail_at = block or {}, fail_at
        self.generated = []  # (step, version) in generation order

    def sync_weights(self, policy):
        self.held = policy.weights_version
        self.refits.append(policy.weights_version)

    def held_weights(self):
        if not self.own_weights_readable:
            return None
        return iter([("w", torch.tensor([float(self.held)]))])

    def generate(self, prompts, n_samples, cfg, seeds):
        step = int(seeds[0])
        self.check_stop()
        if step == self.fail_at:
            raise ValueError("the engine broke")
        event = self.block.get(step)
        while event is not None and not event.wait(0.01):
            self.check_stop()
        time.sleep(self.delay(step))
        self.generated.append((step, self.held))
        return _rollouts(step, self.held, n_samples)


def _pipeline(engine, k, steps, stop=lambda: False):
    return GenerationPipeline(
        engine, _Prompts(), GenerationConfig(), 2, k, ParallelGroups(), steps, stop_requested=stop
    )


def _drive(pipe, steps, start=0, pending=None, train=lambda t: None, held=None):
    """The loop's calls: start, then take (in the step), the update, publish (after it)."""
    policy = _Policy()
    policy.weights_version = start
    pipe.start(start, pending or {}, held, policy)
    seen = []
    for t in range(start, steps):
        ro = pipe.take(t, _Prompts().for_step(t))
        seen.append((t, int(ro.batch.input_ids[0, 1]), pipe.step_metrics(t)["rollout_staleness"]))
        train(t)
        policy.weights_version = t + 1
        pipe.publish(t + 1, policy)
    pipe.close()
    return seen


@pytest.mark.parametrize("k", [1, 2, 3])
def test_batch_t_comes_from_version_t_minus_k_whatever_the_timing(k):
    for seed in range(3):  # engines and trainers of other speeds: the same schedule
        rng = random.Random(seed)
        delays = {t: rng.choice([0.0, 0.002, 0.01]) for t in range(8)}
        engine = _Engine(delay=lambda t: delays[t])
        seen = _drive(_pipeline(engine, k, 8), 8, train=lambda t: time.sleep(rng.random() / 200))
        assert seen == [(t, max(0, t - k), float(min(t, k))) for t in range(8)]
        assert engine.generated == [(t, max(0, t - k)) for t in range(8)]
        assert engine.refits == list(range(1, 9))  # one refit per version, the last for eval


def test_a_resumed_pipeline_takes_the_saved_batches_and_generates_the_rest_on_schedule():
    engine = _Engine()
    engine.held = 3
    pending = {3: (_rollouts(3, 2, 2), 2)}  # generated with version 2 before the stop
    seen = _drive(_pipeline(engine, 1, 6), 6, start=3, pending=pending)
    assert seen == [(3, 2, 1.0), (4, 3, 1.0), (5, 4, 1.0)]
    assert engine.generated == [(4, 3), (5, 4)]  # batch 3 is not generated again


@pytest.mark.parametrize("readable", [True, False])
def test_a_stop_after_an_update_keeps_the_weights_the_cut_batch_was_due_from(tmp_path, readable):
    """k = 1: step 1 updated (weights 2) while batch 2 (version 1) was generating; the stop cut
    it short. The checkpoint keeps the engine's weights of version 1 and the resumed pipeline
    generates batch 2 from them, as the uninterrupted run did. An engine that cannot give its
    weights back (vLLM) resumes with version 2 instead, saying so."""
    gate, stop = threading.Event(), threading.Event()
    engine = _Engine(block={2: gate}, readable=readable)
    pipe = _pipeline(engine, 1, 5, stop=stop.is_set)
    policy = _Policy()
    pipe.start(0, {}, None, policy)
    for t in (0, 1):
        pipe.take(t, None)
        policy.weights_version = t + 1
        if t == 0:
            pipe.publish(1, policy)
    stop.set()  # during step 1's update; the boundary before step 2 waits for nothing
    with pytest.raises(GenerationInterrupted):
        pipe.publish(2, policy)
    names = pipe.pending_writer(2)(tmp_path)
    pipe.close()
    assert names == ["rollouts_rank0.safetensors"] + (
        ["engine_weights_rank0.safetensors"] if readable else []
    )
    resumed = _Engine(readable=readable)
    resumed.held = 2  # the trainer refitted the checkpoint's weights
    pending, held = _pipeline(resumed, 1, 5).load_pending(tmp_path)
    assert pending == {} and (held.version == 1 if readable else held is None)
    seen = _drive(_pipeline(resumed, 1, 5), 5, start=2, held=held)
    if readable:
        assert seen == [(2, 1, 1.0), (3, 2, 1.0), (4, 3, 1.0)]  # the uninterrupted schedule
        assert resumed.refits == [1, 2, 3, 4, 5]
    else:
        assert seen[0] == (2, 2, 0.0) and seen[1:] == [(3, 2, 1.0), (4, 3, 1.0)]


def test_the_trainer_waits_only_for_the_batch_the_bound_needs():
    """k = 1: batch 0 is taken while batch 1 is still being generated; the boundary before
    step 1 returns only once batch 1 exists (it is the one step 1 trains on)."""
    gate = threading.Event()
    engine = _Engine(block={1: gate})
    pipe = _pipeline(engine, 1, 3)
    pipe.start(0)
    pipe.take(0, None)  # would never return if it waited for batch 1
    assert (1, 0) not in engine.generated
    timer = threading.Timer(0.05, gate.set)
    timer.start()
    policy = _Policy()
    policy.weights_version = 1
    pipe.publish(1, policy)
    assert (1, 0) in engine.generated and engine.refits == [1]
    pipe.close()


def test_a_stop_signal_waits_for_no_generation_and_closing_cuts_the_worker_short():
    gate, stop = threading.Event(), threading.Event()
    engine = _Engine(block={1: gate})  # batch 1 never finishes on its own
    pipe = _pipeline(engine, 1, 4, stop=stop.is_set)
    pipe.start(0)
    pipe.take(0, None)
    stop.set()
    raised = []

    def boundary():
        try:
            pipe.publish(1, _Policy())
        except GenerationInterrupted as e:
            raised.append(e)

    waiter = threading.Thread(target=boundary)
    waiter.start()
    waiter.join(timeout=WAIT_S)  # a wait for batch 1 would last forever
    assert raised and engine.refits == []  # no refit after the stop
    pipe.close()  # the engine's should_stop now says yes: the worker ends
    assert not any(t.name == WORKER_NAME for t in threading.enumerate())


class _Uncuttable(_Engine):
    """vLLM's generate: once running it ends on its own time, whatever ``should_stop`` says;
    batch 1 runs until ``gate`` is set."""

    def __init__(self, gate):
        super().__init__()
        self.gate = gate

    def generate(self, prompts, n_samples, cfg, seeds):
        if int(seeds[0]) == 1:
            self.gate.wait()
        return super().generate(prompts, n_samples, cfg, seeds)


def test_after_a_stop_closing_leaves_a_generation_the_engine_cannot_cut_short(monkeypatch, caplog):
    """The worker was joined for up to 60 s, after a stop signal too (SIGUSR1 under the sbatch
    script, whose vLLM engine ignores it): half of the signal's lead spent after the
    checkpoint, with the time limit's kill, and no requeue, behind it. After a stop the wait
    is CLOSE_WAIT_STOPPING_S, then the worker is left to end with the process, warned."""
    import logging

    from nemo_d3s.trainer import pipeline as P

    monkeypatch.setattr(P, "CLOSE_WAIT_S", WAIT_S)  # the end of a run: no limit in this test
    monkeypatch.setattr(P, "CLOSE_WAIT_STOPPING_S", 0.05)
    gate, stop = threading.Event(), threading.Event()
    pipe = _pipeline(_Uncuttable(gate), 1, 4, stop=stop.is_set)
    pipe.start(0)
    pipe.take(0, None)  # batch 1 is generating
    stop.set()
    with caplog.at_level(logging.WARNING, logger="nemo_d3s.trainer"):
        pipe.close()
    assert pipe._thread.is_alive() and "still inside a generation" in caplog.text
    gate.set()
    pipe._thread.join(timeout=WAIT_S)
    assert not pipe._thread.is_alive()


@pytest.mark.parametrize("eval_stopped", [True, False])
def test_no_generation_starts_after_an_evaluation_a_stop_signal_cut_short(eval_stopped):
    """publish released the next batch after ``between()`` whatever it said: a rank that learnt
    of the stop through the evaluation's agreement (its own flag unset) generated during the
    stop's checkpoint."""
    pipe = _pipeline(_Engine(), 1, 4)
    pipe.start(0)
    pipe.take(0, None)
    released = []
    pipe._release = lambda first, last: released.append((first, last))
    pipe.publish(1, _Policy(), between=lambda: eval_stopped)
    assert released == ([] if eval_stopped else [(2, 2)])
    pipe.close()


class _RefitFails(_Engine):
    """The boundary's refit raises (an RPC into an engine going down with the job), after
    ``on_refit()`` ran (a stop signal arriving meanwhile, or not)."""

    def __init__(self, on_refit):
        super().__init__()
        self.on_refit = on_refit

    def sync_weights(self, policy):
        self.on_refit()
        raise RuntimeError("weight sync failed: the engine process ended")


def test_a_refit_a_stop_signal_cuts_short_is_an_interruption_and_the_batches_stay_saved(
    tmp_path,
):
    stop = threading.Event()
    engine = _RefitFails(on_refit=stop.set)
    pipe = _pipeline(engine, 1, 4, stop=stop.is_set)
    pipe.start(0)
    pipe.take(0, None)
    with pytest.raises(GenerationInterrupted, match="during the refit"):
        pipe.publish(1, _Policy())
    pipe.close()
    # the checkpoint of step 1 holds batch 1 (version 0, the schedule's): nothing to regenerate
    assert pipe.pending_writer(1)(tmp_path) == ["rollouts_rank0.safetensors"]
    saved = load_rollouts(tmp_path / "rollouts_rank0.safetensors", (0, 1))
    assert {j: version for j, (_, version) in saved.items()} == {1: 0}


def test_a_refit_that_fails_without_a_stop_signal_is_the_error_itself():
    pipe = _pipeline(_RefitFails(on_refit=lambda: None), 1, 4)
    pipe.start(0)
    pipe.take(0, None)
    with pytest.raises(RuntimeError, match="weight sync failed"):
        pipe.publish(1, _Policy())
    pipe.close()


def test_a_stop_pending_at_the_boundary_skips_the_refit_with_every_batch_generated():
    stop = threading.Event()
    engine = _Engine()
    pipe = _pipeline(engine, 1, 4, stop=stop.is_set)
    pipe.start(0)
    pipe.take(0, None)
    deadline = time.monotonic() + WAIT_S
    while (1, 0) not in engine.generated and time.monotonic() < deadline:
        time.sleep(0.01)  # batch 1 generated: the boundary waits for nothing
    stop.set()
    with pytest.raises(GenerationInterrupted):
        pipe.publish(1, _Policy())
    assert engine.refits == []  # the checkpoint first; the resumed run refits from it
    pipe.close()


def test_a_failed_worker_is_an_error_naming_it_not_a_wait():
    pipe = _pipeline(_Engine(fail_at=1), 1, 4)
    pipe.start(0)
    pipe.take(0, None)
    with pytest.raises(RuntimeError, match=f"{WORKER_NAME} failed on the batch of step 1.*broke"):
        pipe.publish(1, _Policy())
    pipe.close()


def test_a_worker_that_is_gone_is_an_error_not_a_wait():
    pipe = _pipeline(_Engine(), 1, 2)
    pipe.start(0)
    pipe.take(0, None)
    pipe.publish(1, _Policy())  # batch 1 generated; nothing more is released
    pipe.close()  # the worker ends
    with pytest.raises(RuntimeError, match=f"{WORKER_NAME} is not running.*step 2"):
        pipe.take(2, None)


def test_k0_generates_inside_the_step_and_reports_nothing_new():
    engine = _Engine()
    pipe = _pipeline(engine, 0, 2)
    pipe.start(0)
    ro = pipe.take(0, _Prompts().for_step(0))
    assert int(ro.batch.input_ids[0, 0]) == 0 and pipe.step_metrics(0) == {}
    calls = []
    pipe.publish(1, _Policy(), lambda: calls.append(1))
    assert calls == [1] and engine.refits == []  # the synchronous step refits itself
    assert pipe.pending_writer(1) is None and pipe.on_policy


def test_an_engine_sampling_the_policys_own_weights_is_refused():
    engine = _Engine()
    engine.own_weights = False
    with pytest.raises(ValueError, match="own copy of the weights"):
        _pipeline(engine, 1, 2)


def test_pending_rollouts_round_trip_through_a_checkpoint_file(tmp_path):
    gate = threading.Event()
    engine = _Engine(block={3: gate})
    pipe = _pipeline(engine, 2, 6)
    pipe.start(0)
    pipe.take(0, None)
    policy = _Policy()
    policy.weights_version = 1
    pipe.publish(1, policy)  # batches 1 and 2 exist; 3 is held back
    names = pipe.pending_writer(1)(tmp_path)
    gate.set()
    pipe.close()
    back, held = pipe.load_pending(tmp_path)
    assert names == ["rollouts_rank0.safetensors"] and sorted(back) == [1, 2] and held is None
    for j in (1, 2):
        ro, version = back[j]
        want = _rollouts(j, 0, 2)
        assert version == 0 and ro.response_texts == want.response_texts
        for a, b in [
            (ro.batch.input_ids, want.batch.input_ids),
            (ro.batch.response_mask, want.batch.response_mask),
            (ro.sampling_logprobs, want.sampling_logprobs),
            (ro.finished, want.finished),
        ]:
            assert torch.equal(a, b)


def test_a_rollouts_file_is_untrusted(tmp_path):
    path = tmp_path / "r.safetensors"
    save_rollouts(path, {4: (_rollouts(4, 3, 2), 3)}, (0, 1))
    assert sorted(load_rollouts(path, (0, 1))) == [4]
    with pytest.raises(RunError, match="written for prompts \\[0, 1\\].*holds \\(2, 4\\)"):
        load_rollouts(path, (2, 4))
    raw = bytearray(path.read_bytes())
    path.write_bytes(bytes(raw[: len(raw) // 2]))
    with pytest.raises(RunError, match="not a rollouts file"):
        load_rollouts(path, (0, 1))
    from safetensors.torch import save_file

    bad = _rollouts(4, 3, 2)
    save_rollouts(path, {4: (bad, 3)}, (0, 1))
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    tensors["4.text_lengths"] = torch.tensor([1, 10**6])
    meta = {"format": "nemo_d3s.rollouts.v1", "batches": '[{"step": 4, "version": 3}]'}
    save_file(tensors, str(path), metadata={**meta, "prompts": "[0, 1]"})
    with pytest.raises(RunError, match="text sizes"):
        load_rollouts(path, (0, 1))
    save_file(tensors, str(path), metadata={**meta, "format": "x", "prompts": "[0, 1]"})
    with pytest.raises(RunError, match="format 'x'"):
        load_rollouts(path, (0, 1))


def _rank0_among(others: float):
    """(A pipeline on rank 0 of a job whose other ranks send ``others`` into each agreement,
    the values rank 0 sent)."""
    pipe, agreed = _pipeline(_Engine(), 2, 6), []

    class _Groups:
        global_rank, is_main = 0, True

        def max(self, x):
            agreed.append(x)
            return max(x, others)

    pipe.groups = _Groups()
    return pipe, agreed


@pytest.mark.parametrize(
    "case",
    ["mine_other_slice", "another_ranks_other_slice", "mine_unusable", "another_ranks_unusable"],
)
def test_the_ranks_agree_on_the_rollouts_a_checkpoint_keeps(tmp_path, case, caplog):
    """A resume at another data-parallel layout: a rank's file holds another slice of the
    prompts. It raised on that rank only ("remove the file", which its checksums forbid)
    while the others went on into ``start``'s collective and waited. Now every rank learns of
    it: another layout's batches are generated again (warned), an unusable file fails all."""
    import logging

    save_rollouts(tmp_path / "rollouts_rank0.safetensors", {1: (_rollouts(1, 0, 2), 0)}, (0, 1))
    if case == "mine_other_slice":
        save_rollouts(tmp_path / "rollouts_rank0.safetensors", {1: (_rollouts(1, 0, 2), 0)}, (0, 2))
    if case == "mine_unusable":
        (tmp_path / "rollouts_rank0.safetensors").write_bytes(b"garbage")
    # what another rank sends into the agreement: 2 * (1 another slice, 2 unusable)
    others = {"another_ranks_other_slice": 2.0, "another_ranks_unusable": 4.0}.get(case, 0.0)
    pipe, agreed = _rank0_among(others)
    with caplog.at_level(logging.WARNING, logger="nemo_d3s.trainer"):
        if case.endswith("unusable"):
            want = "not a rollouts file" if case == "mine_unusable" else "for another rank"
            with pytest.raises(RunError, match=want):
                pipe.load_pending(tmp_path)
        else:
            assert pipe.load_pending(tmp_path) == ({}, None)
            assert "another data-parallel layout" in caplog.text
    assert len(agreed) == 1  # every rank meets in the one agreement, whatever it found
    assert pipe.load_pending(None) == ({}, None)


@pytest.mark.parametrize("other_holds", [(3, 4), (4,), ()])
def test_ranks_resumed_with_different_saved_batches_generate_them_all_again(other_holds, caplog):
    """k = 2 resumed at step 3 where another rank holds other saved batches (a resume at another
    TP: its new rank has no file). Each rank released only the batches it lacked, and a
    model-parallel engine pairs its ranks' generations by order: one rank trained another's
    rollouts at its step, then the ranks waited for each other. Now they agree first: the
    batches stand only when every rank holds the same ones."""
    import logging

    from nemo_d3s.trainer.pipeline_resume import agreed_pending

    pending = {3: (_rollouts(3, 1, 2), 1), 4: (_rollouts(4, 2, 2), 2)}
    mine, theirs = 0b11, float(sum(1 << (j - 3) for j in other_holds))
    others, sent = iter([theirs, -theirs]), []

    class _Groups:
        global_rank, is_main = 0, True

        def max(self, x):
            sent.append(x)
            return max(x, next(others))

    with caplog.at_level(logging.WARNING, logger="nemo_d3s.trainer"):
        got = agreed_pending(range(3, 5), pending, _Groups())
    assert sent == [mine, -mine]  # every rank meets in both, whatever it holds
    if other_holds == (3, 4):
        assert got is pending and not caplog.text
    else:
        assert got == {} and "different saved rollouts of steps [3, 4]" in caplog.text


def test_the_worker_threads_openmp_team_is_the_trainers_before_it_generates(monkeypatch):
    """The thread's OpenMP team size when the engine is called equals torch's (1 here, set in
    the trainer's thread), not the library default of a new thread (every CPU): vLLM's CPU
    attention planned with the default and ran after torch's first op had set 1, and died
    (``cpu_attn_impl.hpp`` "Check failed: thread_num (2 vs. 1)", rollout.max_staleness=1)."""
    import ctypes
    import os

    omp_get_max_threads = ctypes.CDLL(None).omp_get_max_threads  # torch's libgomp
    seen = []

    class Probe(_Engine):
        def generate(self, prompts, n_samples, cfg, seeds):
            seen.append(omp_get_max_threads())
            return super().generate(prompts, n_samples, cfg, seeds)

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _drive(_pipeline(Probe(), 1, 3), 3)
    finally:
        torch.set_num_threads(n)
    assert seen == [1, 1, 1], (seen, os.cpu_count())


class _FakeCuda:
    """torch.cuda as the worker sees it: a current device per thread (0 in a new one, as the
    CUDA runtime's), streams on a device; ``calls`` records (thread name, call)."""

    def __init__(self):
        self.calls, self.local = [], threading.local()

    def _note(self, *call):
        self.calls.append((threading.current_thread().name, *call))

    def is_available(self):
        return True

    def is_initialized(self):
        return True

    def current_device(self):
        return getattr(self.local, "device", 0)

    def set_device(self, device):
        self._note("set_device", device)
        self.local.device = device

    def Stream(self, device=None):
        cuda = self
        device = self.current_device() if device is None else device
        self._note("Stream", device)

        class Stream:
            def wait_stream(self, other):
                cuda._note("wait", other)

        return Stream()

    def default_stream(self, device=None):
        return f"default:{self.current_device() if device is None else device}"

    @contextlib.contextmanager
    def stream(self, s):
        self._note("enter")
        yield
        self._note("exit")


def test_the_worker_generates_on_the_trainers_gpu_on_a_stream_of_its_own():
    """worker_stream: on a CPU process nothing to switch. On a CUDA one (a stand-in for
    torch.cuda with a current device per thread) the worker thread first selects the
    trainer's device (rank r's worker made a stream, a context and its engine's cache release
    on GPU 0), its stream on that device first waits for that device's default stream (the
    refit's copies), then is current while the engine generates, and only then."""
    from types import SimpleNamespace

    from nemo_d3s.trainer.worker_cuda import trainer_device, worker_stream

    assert trainer_device(torch) is None  # this machine: no CUDA
    assert worker_stream(torch, None) is contextlib.nullcontext
    cuda = _FakeCuda()
    fake = SimpleNamespace(cuda=cuda)
    cuda.set_device(3)  # the trainer's thread: LOCAL_RANK 3
    device, seen = trainer_device(fake), []

    def worker():
        side = worker_stream(fake, device)
        for _ in range(2):
            with side():
                seen.append(cuda.current_device())

    thread = threading.Thread(target=worker, name="w")
    thread.start()
    thread.join()
    one = [("w", "wait", "default:3"), ("w", "enter"), ("w", "exit")]
    assert cuda.calls[1:] == [("w", "set_device", 3), ("w", "Stream", 3), *one, *one]
    assert seen == [3, 3]


def test_the_pipeline_hands_its_worker_the_trainers_device(monkeypatch):
    import nemo_d3s.trainer.pipeline as pipeline

    got = []
    monkeypatch.setattr(pipeline, "trainer_device", lambda torch: 5)
    monkeypatch.setattr(
        pipeline,
        "worker_stream",
        lambda torch, device: (
            got.append((threading.current_thread().name, device)) or contextlib.nullcontext
        ),
    )
    _drive(_pipeline(_Engine(), 1, 2), 2)
    assert got == [(WORKER_NAME, 5)]


def test_held_weights_fit_the_engine_here_by_names_and_shapes():
    held = HeldWeights({"a": torch.zeros(2, 3), "b": torch.zeros(4)}, 5)
    same = [("b", torch.ones(4)), ("a", torch.ones(2, 3))]
    assert held_weights_fit(held, iter(same)) is None
    assert held_weights_fit(HeldWeights({}, 5), iter(())) is None  # no engine then, none now
    assert (
        held_weights_fit(HeldWeights({}, 5), iter(same))
        == "0 weights where this rank holds an engine"
    )
    assert held_weights_fit(held, iter(())) == "2 weights where this rank holds no engine"
    other = [("a", torch.ones(3, 2)), ("b", torch.ones(4))]
    assert "not the 2 of this rank's engine" in held_weights_fit(held, iter(other))
    assert "not the 1 of" in held_weights_fit(held, iter(same[:1]))
    assert held_weights_fit(held, None) is None  # vLLM: the refit checks the names
    assert held_weights_fit(HeldWeights({}, 5), None) == "an empty file for this rank's engine"


@pytest.mark.parametrize("case", ["fits", "mine_empty", "mine_other_shapes", "another_ranks"])
def test_engine_weights_of_another_engine_placement_are_dropped_on_every_rank(
    tmp_path, case, caplog
):
    """A resume at another TP / PP or engine count at the same DP: the ranks' rollouts still
    hold their prompts, but a rank that holds an engine now may read the empty weights file a
    rank without one wrote (or another model's), and refitted from it. Every rank now drops
    the held weights when one rank's do not fit its engine; the batches stand."""
    import logging

    save_rollouts(tmp_path / "rollouts_rank0.safetensors", {1: (_rollouts(1, 0, 2), 0)}, (0, 1))
    weights = {"fits": [("w", torch.zeros(1))], "mine_empty": [], "another_ranks": []}
    weights = weights.get(case, [("w", torch.zeros(2, 2))])
    if case == "another_ranks":  # this rank's file fits; another rank's did not
        weights = [("w", torch.zeros(1))]
    save_held_weights(tmp_path / "engine_weights_rank0.safetensors", weights, 0)
    others = 1.0 if case == "another_ranks" else 0.0
    pipe, agreed = _rank0_among(others)
    with caplog.at_level(logging.WARNING, logger="nemo_d3s.trainer"):
        batches, held = pipe.load_pending(tmp_path)
    assert sorted(batches) == [1] and len(agreed) == 1
    if case == "fits":
        assert held is not None and held.version == 0 and "do not fit" not in caplog.text
        return
    assert held is None and "do not fit this layout's engines" in caplog.text
    want = {"mine_empty": "0 weights where", "mine_other_shapes": "not the 1 of"}
    assert want.get(case, "on another rank") in caplog.text


# ------------------------------------------------------------------ the boundary on 2 ranks
TIMEOUT_S, SLOW_S = 3.0, 8.0  # trainer.dist_timeout_minutes=0.05; rank 1's batch 1 takes SLOW_S


def _two_ranks_at_k1(rank: int, how: str, max_new_tokens: int):
    """k = 1, 3 steps on a gloo rank whose collectives wait TIMEOUT_S for a peer; on rank 1
    only, batch 1 takes SLOW_S (``slow``), or the worker fails on it (``fails``), or a stop
    signal arrives during step 0 (``stop``). The batches' (step, version), or the error."""
    import datetime

    import torch.distributed as dist

    from nemo_d3s.distributed.timeouts import apply_timeout

    apply_timeout(datetime.timedelta(seconds=TIMEOUT_S))
    groups = ParallelGroups(dp=dist.group.WORLD, global_rank=rank)
    mine = rank == 1
    stop = threading.Event()
    slow = {"slow": 1, "slow_first": 0}.get(how) if mine else None
    engine = _Engine(
        delay=lambda t: SLOW_S if t == slow else 0.0,
        fail_at=1 if (mine and how == "fails") else None,
    )
    gen = GenerationConfig(max_new_tokens=max_new_tokens)
    pipe = GenerationPipeline(engine, _Prompts(), gen, 2, 1, groups, 3, stop_requested=stop.is_set)

    def train(t):  # the step's first collective (scoring's), then a stop signal on rank 1
        groups.max(0.0)
        if mine and how == "stop":
            stop.set()

    try:
        seen = _drive(pipe, 3, train=train)
        return [(t, version) for t, version, _ in seen]
    except Exception as e:
        pipe.close()
        return f"{type(e).__name__}: {e}"


def _at_k1(how: str, max_new_tokens: int = 4096):
    from nemo_d3s.distributed.launch import run_on_gloo_ranks

    return run_on_gloo_ranks(_two_ranks_at_k1, 2, how, max_new_tokens, threads=1, timeout=WAIT_S)


@pytest.mark.distributed
def test_a_rank_whose_batch_came_first_waits_out_a_longer_one_past_the_groups_timeout():
    """The 70B long recipe at k = 1: replica A's batch done 31 minutes before replica B's. A
    waited inside the boundary's collective (``groups.max``), limited by
    trainer.dist_timeout_minutes (30): the gloo / NCCL timeout ended the job without a
    checkpoint. Now A waits on the job's store while B beats, as the synchronous step does."""
    assert _at_k1("slow") == [[(0, 0), (1, 0), (2, 1)]] * 2


@pytest.mark.distributed
def test_the_first_batch_after_a_start_is_awaited_on_the_store_too():
    """Batch 0 (the first k after a start or a resume) is awaited by no boundary: rank 0 took
    its own at once and waited for rank 1's inside the step's first collective, within the
    groups' timeout. ``take`` now agrees on the store as a boundary does."""
    assert _at_k1("slow_first") == [[(0, 0), (1, 0), (2, 1)]] * 2


@pytest.mark.distributed
def test_an_engine_that_never_finishes_at_the_boundary_is_a_generation_timeout():
    """Rank 1 beats but its batch outlasts the limit for 2 rows of 16 new tokens (TIMEOUT_S +
    0.4 s): rank 0 says so (k = 0's GenerationTimeout) instead of a collective's timeout;
    rank 1, finished at last, finds rank 0 gone in its next collective (torchrun ends a job
    at its first failed rank)."""
    first, second = _at_k1("slow", max_new_tokens=16)
    assert first.startswith("GenerationTimeout: ") and "still generating after" in first
    assert isinstance(second, str), second  # an error, not the batches


@pytest.mark.distributed
@pytest.mark.parametrize("how", ["stop", "fails"])
def test_a_stop_or_a_failed_worker_on_one_rank_reaches_every_rank_at_the_boundary(how):
    first, second = _at_k1(how)
    if how == "stop":
        want = "GenerationInterrupted: stop requested while waiting for rollouts"
        assert first == second == want
    else:
        assert f"{WORKER_NAME} failed on the batch of step 1" in second and "broke" in second
        assert first.startswith("RuntimeError: ") and "failed on" in first and "other rank" in first
