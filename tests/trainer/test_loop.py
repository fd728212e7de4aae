"""The full loop on the tiny random model + deterministic toy reward, for every D3S preset
and both objectives, and the content of metrics.jsonl."""

from __future__ import annotations

import math

import pytest

from nemo_d3s.core.d3s import PRESETS
from nemo_d3s.trainer.metrics import read_jsonl

from .conftest import FAST, PODS_SMOKE, run_inprocess

REQUIRED = {
    "step",
    "progress",
    "reward_mean",
    "reward_std",
    "n_degenerate_groups",
    "kept_sample_ratio",
    "kept_token_ratio",
    "k_frac",
    "n_keep",
    "update_tokens",
    "update_tokens_total",
    "rollout_tokens",
    "loss",
    "grad_norm",
    "lr",
    "skipped",
    "time_step",
    "wall_time",
}


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_runs_the_loop(tmp_path, preset):
    # (pods keeps 2 of FAST's 4 rollouts: one would be refused, its advantage being 0)
    d3s = PODS_SMOKE if preset == "pods" else [f"d3s={preset}"]
    state, rows = run_inprocess(tmp_path, [*FAST, *d3s])
    assert state.step == 2 and len(rows) == 2
    _assert_trained(rows)
    for r in rows:
        assert r["skipped"] == 0 or r.get("skip_all_equal") == 1
        assert 0 < r["kept_sample_ratio"] <= 1
    if PRESETS[preset].sample_rule == "all":
        assert all(r["kept_sample_ratio"] == 1 for r in rows)
    if PRESETS[preset].token_scope == "all":
        assert all(r["kept_token_ratio"] == 1 for r in rows if not r["skipped"])
    else:
        assert all(r["kept_token_ratio"] < 1 for r in rows if not r["skipped"])


def _assert_trained(rows):
    """A run whose every step was skipped would pass every per-row check vacuously."""
    assert any(r["skipped"] == 0 and r["optimizer_steps"] > 0 for r in rows), (
        "every step was skipped"
    )


@pytest.mark.parametrize("loss", ["gspo", "gspo_token"])
def test_gspo_objectives_run_the_loop(tmp_path, loss):
    state, rows = run_inprocess(
        tmp_path, [*FAST, "algorithm=gspo", f"algorithm.loss={loss}", "d3s=d3s"]
    )
    assert state.step == 2
    _assert_trained(rows)
    assert all(math.isfinite(r["loss"]) for r in rows if not r["skipped"])


def test_kl_reference_and_mini_batches(tmp_path):
    state, rows = run_inprocess(
        tmp_path,
        [
            *FAST,
            "d3s=grpo",
            "algorithm.kl_coef=0.1",
            "trainer.num_mini_batches=2",
            "trainer.micro_batch_size=3",
        ],
    )
    assert state.step == 2
    for r in rows:
        assert r["optimizer_steps"] == 2
        assert r["kl_loss"] >= 0 and "time_reference" in r
    # The second mini-batch runs after an update, so its ratio differs from 1.
    assert any(abs(r["ratio"] - 1) > 0 for r in rows)


def test_metrics_jsonl_content(tmp_path):
    state, rows = run_inprocess(tmp_path, ["trainer.steps=3", "trainer.eval_every=2", "d3s=d3s"])
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert REQUIRED <= r.keys(), REQUIRED - r.keys()
        assert 0 <= r["kept_token_ratio"] <= 1 and 0 < r["kept_sample_ratio"] <= 1
        assert r["update_tokens"] > 0
        # CPU seconds beside wall seconds: the step's covers its phases' (one thread here)
        phases = ("rollout", "reward", "logprob", "update")
        assert all(r[f"time_cpu_{p}"] > 0 for p in phases), r
        assert sum(r[f"time_cpu_{p}"] for p in phases) <= r["time_cpu_step"]
    # schedule follows progress: (N, K) grow from the initial to the final values
    assert [r["progress"] for r in rows] == [0.0, 0.5, 1.0]
    assert rows[0]["k_frac"] == pytest.approx(0.05) and rows[-1]["k_frac"] == pytest.approx(0.2)
    assert rows[0]["n_keep"] == pytest.approx(0.125) and rows[-1]["n_keep"] == pytest.approx(0.5)
    # cumulative counters are running sums
    total = 0.0
    for r in rows:
        total += r["update_tokens"]
        assert r["update_tokens_total"] == pytest.approx(total)
    evals = read_jsonl(tmp_path / "eval.jsonl")
    assert [e["step"] for e in evals] == [0, 2, 3]
    assert all(e["eval_n"] == 8 for e in evals)
    # the run layout
    assert (tmp_path / "config.yaml").is_file()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "step_000002",
        "step_000003",
    ]
    export = tmp_path / "hf_export"
    assert (export / "config.json").is_file() and list(export.glob("*.safetensors"))
    assert list(export.glob("tokenizer*"))


def test_d3s_uses_fewer_update_tokens_than_grpo(tmp_path):
    _, grpo = run_inprocess(tmp_path / "grpo", [*FAST, "d3s=grpo"])
    _, d3s = run_inprocess(tmp_path / "d3s", [*FAST, "d3s=d3s"])
    assert d3s[-1]["update_tokens_total"] < grpo[-1]["update_tokens_total"]


def test_batched_generation_is_reproducible(tmp_path):
    a = run_inprocess(tmp_path / "a", [*FAST, "trainer.generate_per_prompt=false"])[1]
    b = run_inprocess(tmp_path / "b", [*FAST, "trainer.generate_per_prompt=false"])[1]
    strip = lambda rows: [
        {k: v for k, v in r.items() if not k.startswith(("time_", "wall_"))} for r in rows
    ]
    assert strip(a) == strip(b) and len(a) == 2


def test_normalize_by_eligible_rescales_the_first_loss_by_the_kept_token_share(tmp_path):
    # Step 1 sees the same rollouts and selection either way; with token_mean the loss is
    # sum/kept tokens vs sum/eligible tokens, so the ratio is exactly the kept-token share.
    _, kept = run_inprocess(tmp_path / "kept", [*FAST, "d3s=d3s", "trainer.steps=1"])
    _, elig = run_inprocess(
        tmp_path / "elig", [*FAST, "d3s=d3s", "trainer.steps=1", "algorithm.normalize_by=eligible"]
    )
    k, e = kept[0], elig[0]
    assert k["n_kept_tokens"] == e["n_kept_tokens"] < e["n_eligible_tokens"]
    assert k["loss"] != 0
    assert e["loss"] == pytest.approx(
        k["loss"] * e["n_kept_tokens"] / e["n_eligible_tokens"], rel=1e-4
    )


def test_token_budget_micro_batches_train_the_same_with_less_padding(tmp_path):
    """trainer.micro_batch_tokens: the same run (losses, gradient norms, rewards of the
    updated policy) as fixed micro-batches, and a padding share logged for the scoring pass
    and the update that is never above the fixed one's."""
    common = [*FAST, "d3s=d3s", "trainer.micro_batch_size=2", "trainer.logprob_micro_batch_size=2"]
    _, fixed = run_inprocess(tmp_path / "fixed", common)
    _, budget = run_inprocess(tmp_path / "budget", [*common, "trainer.micro_batch_tokens=64"])
    _assert_trained(budget)
    for f, b in zip(fixed, budget):
        for key in ("reward_mean", "loss", "grad_norm", "n_kept_tokens"):
            assert b[key] == pytest.approx(f[key], rel=1e-4, abs=1e-6), key
        for key in ("logprob_padding_share", "update_padding_share"):
            assert 0 <= b[key] <= f[key] < 1, (key, b[key], f[key])
        assert b["logprob_fed_tokens"] <= f["logprob_fed_tokens"]
