"""Data parallel on CPU: `torchrun --nproc_per_node=2` gives the same run as one process on
the same global batch (prompts sharded by rank, per-prompt generation seeds, the DP-global
selector, global loss denominators, gradients averaged over ranks, rows rebalanced), for
every preset and both objectives: same selections, advantages, losses and final weights."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from nemo_d3s.trainer.metrics import is_timing_key, read_jsonl

from .conftest import PODS_SMOKE, REPO, cli_env, run_inprocess
from _limits import WAIT_S  # noqa: E402

pytestmark = pytest.mark.distributed

RUN = [
    "trainer.steps=3",
    "trainer.eval_every=0",
    "trainer.eval_at_start=false",
    "trainer.save_every=0",
    "trainer.max_new_tokens=12",
    "task.eval_size=4",
]
PRESETS = ["grpo", "pods", "d1s", "d1s_cross", "d2s", "d3s", "d3s_i"]
# Differ between layouts by design: the load balance of the 2-rank run, and the positions
# each layout's micro-batches feed the model (padding depends on how rows are grouped).
LAYOUT_KEYS = {
    "dp_imbalance_before",
    "dp_imbalance_after",
    "logprob_fed_tokens",
    "logprob_padding_share",
    "update_fed_tokens",
    "update_padding_share",
}


def _torchrun_plan(tmp_path, plan):
    """All runs of ``plan`` (override lists) in one 2-rank launch."""
    path = tmp_path / "plan.json"
    path.write_text(json.dumps([["experiment=smoke", *o] for o in plan]))
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(REPO / "tests" / "trainer" / "_multi_train.py"),
            str(path),
        ],
        cwd=REPO,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )


def _assert_same_run(rows1, rows2, what, rel=1e-4):
    assert len(rows1) == len(rows2), what
    for a, b in zip(rows1, rows2):
        keys = {k for k in a if not is_timing_key(k)} - LAYOUT_KEYS
        assert keys == {k for k in b if not is_timing_key(k)} - LAYOUT_KEYS, what
        for k in sorted(keys):
            va, vb = a[k], b[k]
            if (
                isinstance(va, float)
                and not va.is_integer()
                or isinstance(vb, float)
                and not vb.is_integer()
            ):
                # gradients are summed in another order across ranks: rounding-level drift
                # (observed: < 1e-7 relative)
                assert math.isclose(va, vb, rel_tol=rel, abs_tol=1e-6 if rel else 0.0), (
                    what,
                    a["step"],
                    k,
                    va,
                    vb,
                )
            else:
                assert va == vb, (what, a["step"], k, va, vb)


def _assert_same_weights(one, two, what):
    w1 = load_file(str(one / "hf_export" / "model.safetensors"))
    w2 = load_file(str(two / "hf_export" / "model.safetensors"))
    assert w1.keys() == w2.keys(), what
    for k in w1:
        # Adam's first steps amplify rounding in tiny gradients (lr * g / (|g| + eps)).
        torch.testing.assert_close(w1[k], w2[k], rtol=1e-4, atol=1e-5, msg=f"{what}: {k}")


def _compare(tmp_path, cases, extra=()):
    """cases: (name, overrides). Each runs in this process and in one shared 2-rank launch."""
    plan = []
    for name, overrides in cases:
        run_inprocess(tmp_path / f"one_{name}", [*RUN, *extra, *overrides])
        plan.append([*RUN, *extra, *overrides, f"output_dir={tmp_path / f'two_{name}'}"])
    r = _torchrun_plan(tmp_path, plan)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    for name, _ in cases:
        one, two = tmp_path / f"one_{name}", tmp_path / f"two_{name}"
        rows1, rows2 = read_jsonl(one / "metrics.jsonl"), read_jsonl(two / "metrics.jsonl")
        assert any(row["optimizer_steps"] > 0 for row in rows1), (
            f"{name}: no step trained; the test would be vacuous"
        )
        _assert_same_run(rows1, rows2, name)
        _assert_same_run(read_jsonl(one / "eval.jsonl"), read_jsonl(two / "eval.jsonl"), name)
        _assert_same_weights(one, two, name)
        # rank 0 alone writes train.log: each step's line once, no rank's lines between
        log_steps = [
            ln.split("] - step ")[1].split(":")[0]
            for ln in (two / "train.log").read_text().splitlines()
            if "] - step " in ln and "reward=" in ln
        ]
        assert log_steps == [str(r["step"]) for r in rows2], (name, log_steps)
        for row in rows2:
            if "dp_imbalance_after" in row:
                assert row["dp_imbalance_after"] <= row["dp_imbalance_before"] + 1e-12, (name, row)
    return plan


@pytest.mark.slow  # a whole program run (or several): the slow tier
@pytest.mark.parametrize("algorithm", ["grpo", "gspo"])
def test_two_ranks_match_one_process_for_every_preset(tmp_path, algorithm):
    cases = [
        (p, [*(PODS_SMOKE if p == "pods" else [f"d3s={p}"]), f"algorithm={algorithm}"])
        for p in PRESETS
    ]
    _compare(tmp_path, cases)


@pytest.mark.slow  # a whole program run (or several): the slow tier
def test_padding_metrics_are_global_under_dp(tmp_path):
    """Issue 32 (a mutant that survived): the padding metrics were left out of the layout
    comparison, so rank-local counts passed. With one row per micro-batch (scoring and
    update) no layout groups rows differently, so the fed-token counts and padding shares
    of the 2-rank run must equal one process's: totals over both ranks."""
    one_row = ["trainer.micro_batch_size=1", "trainer.logprob_micro_batch_size=1", "d3s=d3s"]
    _compare(tmp_path, [("one_row", one_row)])
    rows1 = read_jsonl(tmp_path / "one_one_row" / "metrics.jsonl")
    rows2 = read_jsonl(tmp_path / "two_one_row" / "metrics.jsonl")
    padding = sorted(k for k in LAYOUT_KEYS if k.endswith(("fed_tokens", "padding_share")))
    assert all(k in rows1[0] for k in padding), sorted(rows1[0])
    for a, b in zip(rows1, rows2):
        for k in padding:
            assert math.isclose(a[k], b[k], rel_tol=1e-12, abs_tol=1e-12), (
                a["step"],
                k,
                a[k],
                b[k],
            )
    assert any(r["update_fed_tokens"] > 0 for r in rows1)


@pytest.mark.slow
def test_two_ranks_match_with_kl_mini_batches_and_without_rebalancing(tmp_path):
    """Mini-batches whose share is empty on one rank, the reference model, the eligible
    normaliser, and the unbalanced path (an empty rank runs train_step on no rows)."""
    base = ["d3s=d3s", "algorithm.kl_coef=0.05", "trainer.num_mini_batches=2", "trainer.steps=4"]
    cases = [
        ("rebalanced", base),
        (
            "unbalanced",
            [
                *base,
                "trainer.dp_rebalance=false",
                "algorithm.normalize_by=eligible",
                "algorithm.aggregation=seq_mean_token_mean",
            ],
        ),
    ]
    _compare(tmp_path, cases)
    rows = read_jsonl(tmp_path / "two_rebalanced" / "metrics.jsonl")
    assert any(r["optimizer_steps"] == 2 for r in rows)
    assert "dp_imbalance_before" not in read_jsonl(tmp_path / "two_unbalanced" / "metrics.jsonl")[0]
