"""Megatron's DistributedDataParallel + distributed optimizer (the backend's CUDA default,
``model.params.distributed_optimizer=true``) on gloo ranks, through ``cpu_compat``.

The folders (conftest.py) and the batch (``_tiny_hf.tiny_batch``) are test_backend.py's.
The reference is the backend's plain path (``distributed_optimizer=false``: AdamW over each
rank's shards, the path test_backend.py checks against the HF backend) on the same rows,
weights and LR schedule. Checked:

- two ``train_step`` s at DP2 (untied Llama) and TP1 x PP2 x DP2 (tied Qwen2: the
  embedding's two copies reduced across stages by Megatron's ``finalize_model_grads``) give
  the plain path's grad norms (rel 1e-5) and weights (atol 1e-6, fp32);
- the Adam moments a checkpoint holds (gathered from the DP ranges to DP rank 0) equal the
  plain AdamW's full moments (atol 1e-7: fp32 summation order only);
- resume in the same layout is bit-exact, fp32 and bf16 (bf16 needs the fp32 main weights,
  saved as ``optim.main.*``: resuming from the bf16 parameters instead would differ);
- a plain checkpoint resumes with the distributed optimizer and a distributed-optimizer
  checkpoint resumes with plain AdamW on one process (optimizer tolerance), and a resume that
  lost the optimizer state would be caught (a fresh second step differs).
"""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "distributed"))
from _launch import run_ranks  # noqa: E402
from _tiny_hf import B, tiny_batch  # noqa: E402
from _limits import WAIT_S  # noqa: E402

pytestmark = pytest.mark.distributed

MBS = 2
OPT = dict(
    lr=1e-2,
    adam_eps=1e-3,
    weight_decay=0.01,
    grad_clip=0.5,
    scheduler="linear",
    total_steps=10,
    warmup_steps=1,
)
DP_ROWS = [[0, 1, 2, 3], [4, 5]]  # unequal micro-batch counts on the two DP ranks


def _backend(folder, tp, pp, dopt, dtype):
    from nemo_d3s.backends.megatron.backend import MegatronBackend
    from nemo_d3s.backends.megatron.config import MegatronBackendConfig

    return MegatronBackend(
        MegatronBackendConfig(
            model=folder,
            device="cpu",
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            distributed_optimizer=dopt,
            dtype=dtype,
            **OPT,
        )
    )


def _steps(pol, n):
    """``n`` GRPO steps on this DP rank's rows; the grad norms."""
    from megatron.core import parallel_state as ps

    from nemo_d3s.core.losses import loss_denominator
    from nemo_d3s.trainer.update import one_minibatch_loss_fn

    batch, adv, noise, keep = tiny_batch()
    dp = ps.get_data_parallel_world_size()
    rows = torch.tensor(DP_ROWS[ps.get_data_parallel_rank()] if dp == 2 else list(range(B)))
    local = batch.select(rows)
    norms = []
    for _ in range(n):
        lp = pol.score(local, with_entropy=False, micro_batch_size=MBS).logprobs
        loss_fn = one_minibatch_loss_fn(local, lp + noise[rows], adv[rows], keep[rows])
        m = pol.train_step(
            local, loss_fn, MBS, denominator=float(loss_denominator(keep, "token_mean"))
        )
        norms.append(m["grad_norm"])
    return norms


def _rank_run(rank, folder, tp, pp, dopt, dtype, save, load, n_before, n_after):
    """[load ``load``], ``n_before`` steps, [save to ``save``], ``n_after`` steps; returns the
    optimizer's class, grad norms, the HF-named weights and the LR."""
    pol = _backend(folder, tp, pp, dopt, dtype)
    if load:
        pol.load_checkpoint(load)
    norms = _steps(pol, n_before)
    if save:
        pol.save_checkpoint(save)
    norms += _steps(pol, n_after)
    weights = {k: v.detach().float().clone() for k, v in pol.hf_weights()}
    return type(pol.optimizer).__name__, norms, weights, pol.optimizer.param_groups[0]["lr"]


def _moments(ckpt):
    """{key: tensor} of every optim.* tensor in a checkpoint's shard files."""
    from safetensors.torch import load_file

    root = os.path.join(ckpt, "megatron")
    out = {}
    for f in sorted(os.listdir(root)):
        if f.endswith(".safetensors"):
            out.update(
                {
                    f"{f}:{k}": v
                    for k, v in load_file(os.path.join(root, f)).items()
                    if k.startswith("optim.")
                }
            )
    return out


def _metadata(ckpt, shard="tp00_pp00.safetensors"):
    from safetensors import safe_open

    with safe_open(os.path.join(ckpt, "megatron", shard), framework="pt") as f:
        return f.metadata()


LAYOUTS = {"dp2": ("llama", 1, 1, 2), "pp2dp2": ("qwen2", 1, 2, 4)}


@pytest.mark.parametrize(
    "layout",
    # pp2dp2, a 4-rank run of 20-30 s: the slow tier (docs/ci.md); dp2 every run
    [pytest.param(k, marks=pytest.mark.slow) if k == "pp2dp2" else k for k in LAYOUTS],
)
def test_matches_plain_adamw_and_gathers_its_moments(layout, folders, tmp_path):
    arch, tp, pp, world = LAYOUTS[layout]
    runs = {}
    for dopt in (True, False):
        ckpt = str(tmp_path / f"ckpt_{dopt}")
        runs[dopt] = (
            ckpt,
            run_ranks(
                _rank_run,
                world,
                folders[arch],
                tp,
                pp,
                dopt,
                "float32",
                ckpt,
                None,
                2,
                0,
                tp=tp,
                pp=pp,
                timeout=WAIT_S,
            ),
        )
    (_, dist_res), (_, plain_res) = runs[True], runs[False]
    assert {r[0] for r in dist_res} == {"ChainedOptimizer"} and {r[0] for r in plain_res} == {
        "AdamW"
    }
    for d, p in zip(dist_res, plain_res):
        assert d[1] == pytest.approx(p[1], rel=1e-5) and min(p[1]) > 0
        assert d[3] == p[3]
        for k in p[2]:
            torch.testing.assert_close(
                d[2][k], p[2][k], rtol=0, atol=1e-6, msg=lambda m: f"{layout} {k}: {m}"
            )
    got, want = _moments(runs[True][0]), _moments(runs[False][0])
    assert sorted(got) == sorted(want) and len(want) > 0
    for k in want:
        torch.testing.assert_close(
            got[k], want[k], rtol=1e-5, atol=1e-7, msg=lambda m: f"{layout} {k}: {m}"
        )
    assert _metadata(runs[True][0])["optimizer_step"] == "2"


@pytest.mark.parametrize(
    "dopt,dtype",
    # the distributed optimizer in bf16 (fp32 main weights) every run, the two others slow
    [
        pytest.param(True, "float32", marks=pytest.mark.slow),
        (True, "bfloat16"),
        pytest.param(False, "bfloat16", marks=pytest.mark.slow),
    ],
    ids=["distributed-fp32", "distributed-bf16", "plain-bf16"],
)
def test_resume_is_bit_exact(dopt, dtype, folders, tmp_path):
    """bf16 with either optimizer keeps fp32 main weights (the plain one: MainWeightsAdamW)."""
    folder, ckpt = folders["llama"], str(tmp_path / "ckpt")
    want = run_ranks(_rank_run, 2, folder, 1, 1, dopt, dtype, ckpt, None, 1, 1, timeout=WAIT_S)
    assert _metadata(ckpt)["main_params"] == ("1" if dtype == "bfloat16" else "0")
    if dtype == "bfloat16":  # the fp32 main weights are not the bf16 parameters
        from safetensors.torch import load_file

        shard = load_file(os.path.join(ckpt, "megatron", "tp00_pp00.safetensors"))
        mains = [k for k in shard if k.startswith("optim.main.")]
        assert mains and any(not torch.equal(shard[k].bfloat16().float(), shard[k]) for k in mains)
    got = run_ranks(_rank_run, 2, folder, 1, 1, dopt, dtype, None, ckpt, 1, 0, timeout=WAIT_S)
    for w, g in zip(want, got):
        assert g[1][-1] == w[1][-1] and g[3] == w[3]
        for k in w[2]:
            assert torch.equal(g[2][k], w[2][k]), (dtype, k)


def _rank_load_counting(rank, folder, ckpt):
    """Load ``ckpt`` at DP 2 counting the bytes each read through the checkpoint reader
    returns, by family: {"params": n, "optim": n}; and this rank's range elements x 4 bytes
    x the optimizer families it restores."""
    from nemo_d3s.backends.megatron import optimizer_state as ostate
    from nemo_d3s.formats.shards import ShardedReader

    counted = {"params": 0, "optim": 0}
    read = ShardedReader._read

    def counting(self, layout, key, rows=None):
        t, shape = read(self, layout, key, rows)
        counted["optim" if key.startswith("optim.") else "params"] += t.numel() * t.element_size()
        return t, shape

    ShardedReader._read = counting
    try:
        pol = _backend(folder, 1, 1, True, "bfloat16")
        pol.load_checkpoint(ckpt)
    finally:
        ShardedReader._read = read
    share = sum(b - a for a, b in ostate.local_ranges(pol.optimizer).values())
    return counted, share * 4 * 3  # fp32 exp_avg, exp_avg_sq, main weights


@pytest.mark.slow  # a multi-rank equality run of 20-60 s: the slow tier (docs/ci.md)
def test_each_dp_rank_reads_only_its_share_of_the_optimizer_state(folders, tmp_path):
    """Resume at DP 2 with Megatron's distributed optimizer: each rank reads the rows that
    hold its own range of every moment and main weight (its share, up to one row at each
    end of a range), not the whole state; together the two ranks read it about once. The
    parameters are read whole on every rank (each holds the whole model copy)."""
    from safetensors import safe_open

    folder, ckpt = folders["llama"], str(tmp_path / "ckpt")
    run_ranks(_rank_run, 2, folder, 1, 1, True, "bfloat16", ckpt, None, 1, 0, timeout=WAIT_S)
    with safe_open(os.path.join(ckpt, "megatron", "tp00_pp00.safetensors"), "pt") as f:
        sizes = {k: f.get_slice(k).get_shape() for k in f.keys()}
    optim_bytes = sum(4 * math.prod(s) for k, s in sizes.items() if k.startswith("optim."))
    widest_row = max(4 * math.prod(s[1:]) for k, s in sizes.items() if k.startswith("optim."))
    n_tensors = sum(1 for k in sizes if k.startswith("optim."))
    results = run_ranks(_rank_load_counting, 2, folder, ckpt, timeout=WAIT_S)
    for counted, share in results:
        assert share <= counted["optim"] <= share + 2 * n_tensors * widest_row, (counted, share)
        assert counted["optim"] < 0.6 * optim_bytes
    assert sum(c["optim"] for c, _ in results) <= optim_bytes + 4 * n_tensors * widest_row
    assert sum(s for _, s in results) == optim_bytes  # the ranges cover the state once


def _rank_save_counting(rank, folder, ckpt):
    """One step at DP 2 (distributed optimizer, bf16), then a save that counts, on the writing
    rank, the gathered bytes alive (yielded by the gather, not yet written to the file) at
    every moment: its peak, the largest gathered tensor and the bytes the file received."""
    from nemo_d3s.backends.megatron import optimizer_state as ostate
    from nemo_d3s.formats.safetensors_stream import StreamingSafetensors

    pol = _backend(folder, 1, 1, True, "bfloat16")
    _steps(pol, 1)
    alive = {"bytes": 0, "peak": 0, "largest": 0, "written": 0}
    gather, write = ostate.iter_gathered_states, StreamingSafetensors.write

    def counting_gather(*a, **k):
        for key, t in gather(*a, **k):
            if t is not None:
                n = t.numel() * t.element_size()
                alive["bytes"] += n
                alive["peak"] = max(alive["peak"], alive["bytes"])
                alive["largest"] = max(alive["largest"], n)
            yield key, t

    def counting_write(self, name, t):
        write(self, name, t)
        alive["written"] += t.numel() * t.element_size()
        if name.startswith("optim."):
            alive["bytes"] -= t.numel() * t.element_size()

    ostate.iter_gathered_states, StreamingSafetensors.write = counting_gather, counting_write
    try:
        pol.save_checkpoint(ckpt)
    finally:
        ostate.iter_gathered_states, StreamingSafetensors.write = gather, write
    return alive


def test_the_writer_streams_the_gathered_optimizer_state(folders, tmp_path):
    """The shard writer holds one gathered tensor at a time: each goes to the file before the
    next is gathered (peak = the largest tensor, not the stage's state); the file holds
    every byte, and a resume from it equals a run that never stopped (the test above)."""
    folder, ckpt = folders["llama"], str(tmp_path / "ckpt")
    counts = run_ranks(_rank_save_counting, 2, folder, ckpt, timeout=WAIT_S)
    (writer,) = [c for c in counts if c["written"]]  # TP 1 x PP 1: one shard, one writer
    assert writer["largest"] > 0 and writer["peak"] == writer["largest"], writer
    moments = _moments(ckpt)
    gathered = sum(v.numel() * 4 for v in moments.values())
    assert writer["peak"] * 4 < gathered  # far below holding the stage's gathered state
    shard = os.path.join(ckpt, "megatron", "tp00_pp00.safetensors")
    with open(shard, "rb") as f:
        header = int.from_bytes(f.read(8), "little")
    assert os.path.getsize(shard) == 8 + header + writer["written"]  # every tensor's bytes


@pytest.mark.slow  # a multi-rank equality run of 20-60 s: the slow tier (docs/ci.md)
def test_checkpoints_move_between_the_two_optimizers(folders, tmp_path):
    folder = folders["llama"]
    plain_ckpt, dist_ckpt = str(tmp_path / "plain"), str(tmp_path / "dist")
    plain = run_ranks(
        _rank_run, 2, folder, 1, 1, False, "float32", plain_ckpt, None, 1, 1, timeout=WAIT_S
    )[0]
    dist = run_ranks(
        _rank_run, 2, folder, 1, 1, True, "float32", dist_ckpt, None, 1, 1, timeout=WAIT_S
    )[0]
    # plain checkpoint -> distributed optimizer, same layout
    resumed = run_ranks(
        _rank_run, 2, folder, 1, 1, True, "float32", None, plain_ckpt, 1, 0, timeout=WAIT_S
    )[0]
    # distributed-optimizer checkpoint -> plain AdamW in one process (DP1: all rows)
    (one,) = run_ranks(
        _rank_run, 1, folder, 1, 1, False, "float32", None, dist_ckpt, 1, 0, timeout=WAIT_S
    )
    # the same second step from the checkpoint's weights but a fresh optimizer: must differ
    (fresh,) = run_ranks(_rank_fresh_optimizer, 1, folder, dist_ckpt, timeout=WAIT_S)
    moved = 0
    for k in plain[2]:
        torch.testing.assert_close(
            resumed[2][k], plain[2][k], rtol=0, atol=1e-6, msg=lambda m: f"{k}: {m}"
        )
        torch.testing.assert_close(
            one[2][k], dist[2][k], rtol=0, atol=1e-5, msg=lambda m: f"{k}: {m}"
        )
        moved += int((fresh[k] - dist[2][k]).abs().max() > 1e-4)
    assert moved
    assert resumed[3] == plain[3] and one[3] == dist[3]


def _rank_fresh_optimizer(rank, folder, ckpt):
    """The checkpoint's weights (loaded into a plain backend whose moments are then dropped)
    and one step with a fresh AdamW at the checkpoint's LR step."""
    pol = _backend(folder, 1, 1, False, "float32")
    pol.load_checkpoint(ckpt)
    pol.optimizer.state.clear()
    _steps(pol, 1)
    return {k: v.detach().float().clone() for k, v in pol.hf_weights()}


def _rank_step0_checkpoint(rank, folder, ckpt, mode):
    """bf16, distributed optimizer. "save": shift every weight by 0.25 and save before any
    step (optimizer step 0). "load": load that, take one step; the weights before and after."""
    pol = _backend(folder, 1, 1, True, "bfloat16")
    if mode == "save":
        with torch.no_grad():
            for p in pol.model.parameters():
                p.add_(0.25)
        pol.save_checkpoint(ckpt)
        return None
    pol.load_checkpoint(ckpt)
    before = {k: v.detach().float().clone() for k, v in pol.hf_weights()}
    _steps(pol, 1)
    return before, {k: v.detach().float().clone() for k, v in pol.hf_weights()}


def test_a_step_zero_checkpoint_sets_the_fp32_main_weights(folders, tmp_path):
    """The distributed optimizer's fp32 main weights must follow the loaded bf16 weights even
    when the checkpoint holds no optimizer state (step 0): else the first step copies the
    weights the model was built with back over the loaded ones."""
    folder, ckpt = folders["llama"], str(tmp_path / "ckpt")
    run_ranks(_rank_step0_checkpoint, 2, folder, ckpt, "save", timeout=WAIT_S)
    assert _metadata(ckpt)["optimizer_step"] == "0"
    before, after = run_ranks(_rank_step0_checkpoint, 2, folder, ckpt, "load", timeout=WAIT_S)[0]
    for k in before:  # one step of lr 1e-2 Adam moves a weight by ~1e-2, never back by 0.25
        assert float((after[k] - before[k]).abs().max()) < 0.05, k


class _FusedAdamLike:
    """What ``scatter_states`` / ``optimizer_step`` see of megatron-core's DistributedOptimizer
    over Transformer Engine's FusedAdam (the GPU case): Adam's step per param GROUP, no
    ``step`` in the per-parameter state; fp32 main weights are views of the parameters."""

    class _Range:
        def __init__(self, start, end):
            self.start, self.end = start, end

    def __init__(self, params, lo, hi):
        self.model_param_group_index_map = {p: (0, i) for i, p in enumerate(params)}
        self.ranges = {p: self._Range(lo, hi) for p in params}
        self.main = {p: p.detach().view(-1)[lo:hi] for p in params}
        self.optimizer = type("Inner", (), {})()
        self.optimizer.state = {}
        self.optimizer.param_groups = [{"params": list(self.main.values())}]
        self.dummy_steps = 0

    def _get_model_param_range_map(self, p):
        return {"param": self.ranges[p]}

    def _get_main_param_and_optimizer_states(self, p):
        return {"param": self.main[p], **self.optimizer.state.get(self.main[p], {})}

    def _set_main_param_and_optimizer_states(self, p, tensors):
        dst = self._get_main_param_and_optimizer_states(p)
        for k in dst:
            dst[k].copy_(tensors[k])

    def _init_optimizer_states_with_dummy_values(self):
        self.dummy_steps += 1
        for g in self.optimizer.param_groups:
            g["step"] = 1
            for m in g["params"]:
                m.mul_(0.5)  # a dummy step moves the main weights (weight decay)
                self.optimizer.state[m] = {
                    "exp_avg": torch.zeros_like(m),
                    "exp_avg_sq": torch.zeros_like(m),
                }


def test_per_group_step_counts_and_ranges_hand_worked():
    """One 2 x 3 parameter whose elements [2, 5) this rank holds: scatter writes exactly that
    range of the main weights and moments, restores the step in the param group (FusedAdam),
    and the main weights are read before the dummy step that moves them."""
    from nemo_d3s.backends.megatron import optimizer_state as optim

    w = torch.arange(6, dtype=torch.float32).view(2, 3).clone()
    inner = _FusedAdamLike([w], 2, 5)
    chained = type("Chained", (), {"chained_optimizers": [inner]})()
    assert optim.optimizer_step(chained) == 0 and optim.local_ranges(chained) == {w: (2, 5)}
    ranged = {
        "w": {"exp_avg": torch.tensor([1.0, 2.0, 3.0]), "exp_avg_sq": torch.tensor([4.0, 5.0, 6.0])}
    }
    optim.scatter_states(chained, [("w", w)], ranged, step=7)
    assert inner.dummy_steps == 1 and optim.optimizer_step(chained) == 7
    assert torch.equal(
        w.view(-1), torch.arange(6, dtype=torch.float32)
    )  # main = the weights before the dummy step
    st = inner.optimizer.state[inner.main[w]]
    assert torch.equal(st["exp_avg"], torch.tensor([1.0, 2.0, 3.0])) and torch.equal(
        st["exp_avg_sq"], ranged["w"]["exp_avg_sq"]
    )
    got = dict(optim.iter_gathered_states(chained, [("w", w)], None, with_main=True, step=7))
    assert list(got) == [
        k for k, _, _ in optim.gathered_entries([("w", w)], with_main=True, step=7)
    ]
    assert torch.equal(got["optim.exp_avg.w"], torch.tensor([[0.0, 0.0, 1.0], [2.0, 3.0, 0.0]]))
    assert torch.equal(got["optim.main.w"], torch.tensor([[0.0, 0.0, 2.0], [3.0, 4.0, 0.0]]))
    assert not list(optim.iter_gathered_states(chained, [("w", w)], None, with_main=False, step=0))


def _rank_nonfinite(rank, folder, dopt, dtype):
    """A step whose gradient is NaN on DP rank 1 only, then a finite one: each step's
    ``skipped`` and LR schedule steps, and the HF-named weights before, after the first and
    after the second."""
    from megatron.core import parallel_state as ps

    from nemo_d3s.core.losses import loss_denominator
    from nemo_d3s.trainer.update import one_minibatch_loss_fn

    pol = _backend(folder, 1, 1, dopt, dtype)
    batch, adv, noise, keep = tiny_batch()
    rows = torch.tensor(DP_ROWS[ps.get_data_parallel_rank()])
    local = batch.select(rows)
    denominator = float(loss_denominator(keep, "token_mean"))

    def weights():
        return {k: v.detach().float().clone() for k, v in pol.hf_weights()}

    out = {"w0": weights()}
    for step, poison in ((1, rank == 1), (2, False)):
        lp = pol.score(local, with_entropy=False, micro_batch_size=MBS).logprobs
        a = adv[rows] * (float("nan") if poison else 1.0)
        loss_fn = one_minibatch_loss_fn(local, lp + noise[rows], a, keep[rows])
        m = pol.train_step(local, loss_fn, MBS, denominator=denominator)
        out[f"skipped{step}"] = m["skipped"]
        out[f"lr_steps{step}"] = pol.scheduler.step_count
        out[f"w{step}"] = weights()
    return out


@pytest.mark.parametrize("dopt,dtype", [(True, "bfloat16"), (False, "bfloat16")])
def test_a_non_finite_gradient_on_one_rank_is_skipped_on_every_rank(dopt, dtype, folders):
    """Megatron's optimizer checks for inf / NaN only under a loss scaler, which bf16 runs
    have none of: its step put one rank's NaN gradient into every weight (reported as taken).
    Now both optimizers skip the step on every rank, weights and LR unchanged, and the next
    finite step trains."""
    runs = run_ranks(_rank_nonfinite, 2, folders["llama"], dopt, dtype, timeout=WAIT_S)
    for r in runs:
        assert r["skipped1"] == 1.0 and r["skipped2"] == 0.0
        assert (r["lr_steps1"], r["lr_steps2"]) == (0, 1)  # the LR schedule waited
        for k, w in r["w0"].items():
            assert torch.equal(r["w1"][k], w), k
            assert torch.isfinite(r["w2"][k]).all(), k
        assert any(not torch.equal(r["w2"][k], w) for k, w in r["w0"].items())
    for k in runs[0]["w2"]:
        assert torch.equal(runs[0]["w2"][k], runs[1]["w2"][k]), k


def _rank_full_disk(rank, folder, ckpt):
    """The distributed-optimizer save with the writer's disk full at its first optimizer
    tensor, then a step: whether this rank's save raised, and the step's grad norm."""
    import contextlib

    import nemo_d3s.backends.megatron.checkpoint as ck

    real = ck.open_shard

    @contextlib.contextmanager
    def full_disk(*args, **kwargs):
        with real(*args, **kwargs) as f:

            class Writer:
                def write(self, key, value):
                    if key.startswith("optim."):
                        raise OSError(28, "No space left on device")
                    f.write(key, value)

            yield Writer()

    pol = _backend(folder, 1, 1, True, "float32")
    _steps(pol, 1)  # an optimizer state to gather
    ck.open_shard = full_disk
    try:
        pol.save_checkpoint(ckpt)
        raised = None
    except OSError as e:
        raised = str(e)
    finally:
        ck.open_shard = real
    return {"raised": raised, "norms": _steps(pol, 1)}


def test_a_full_disk_in_the_writers_gather_is_its_error_not_a_hang(folders, tmp_path):
    """The writer of a shard stopped reading the optimizer state's gather at its write error,
    while the other DP ranks sat in the reduces still to come: the job hung until the
    collective timeout. Now it serves them, then raises (the trainer agrees on the outcome),
    and the ranks go on in step."""
    runs = run_ranks(_rank_full_disk, 2, folders["llama"], str(tmp_path / "ckpt"), timeout=WAIT_S)
    raised = [r["raised"] for r in runs]
    assert sum(x is not None for x in raised) == 1  # the writer alone
    assert "No space left on device" in next(x for x in raised if x)
    assert runs[0]["norms"] == runs[1]["norms"] and math.isfinite(runs[0]["norms"][0])
