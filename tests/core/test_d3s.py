"""D3SSelector: presets, the two stages against slow references, a hand-worked case, errors,
structured-config use, and the nemo_d3s.core package exports."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Optional

import pytest
import torch

from nemo_d3s.core.advantages import compute_advantages
from nemo_d3s.core.d3s import PRESETS, D3SConfig, D3SSelector, SampleStage, TokenStage
from nemo_d3s.core.sample_selection import max_variance_subset, resolve_n_keep
from nemo_d3s.core.schedules import DynamicSchedule

G = 8
N_GROUPS = 6
S = 12
PROMPT_LEN = 2
DEGENERATE = (1, 4)  # group positions whose rewards are all equal
PRESET_NAMES = ("grpo", "pods", "d1s", "d1s_cross", "d2s", "d3s", "d3s_i")
PROGRESS = (0.0, 0.5, 1.0)


# ----------------------------------------------------------------------------- fixtures


def make_batch(seed: int = 0):
    """6 prompts x G=8 rollouts, rows shuffled, arbitrary group ids; groups 1 and 4 are
    degenerate (all 0, all 1); group 2 has continuous rewards; the others are binary with
    both outcomes present. Responses start at position 2 and have random lengths (one is
    empty); entropy is 100 on non-eligible positions so any leak shows up."""
    g = torch.Generator().manual_seed(seed)
    r = (torch.rand(N_GROUPS, G, generator=g) < 0.5).float()
    r[:, 0], r[:, 1] = 1.0, 0.0
    r[1] = 0.0
    r[4] = 1.0
    r[2] = torch.rand(G, generator=g)
    ids = torch.tensor([11, 3, 7, 42, 5, 0]).repeat_interleave(G)
    perm = torch.randperm(N_GROUPS * G, generator=g)
    rewards, group_ids = r.flatten()[perm], ids[perm]
    b = rewards.numel()
    lengths = torch.randint(1, S - PROMPT_LEN + 1, (b,), generator=g)
    lengths[5] = 0
    pos = torch.arange(S)
    response_mask = (pos >= PROMPT_LEN) & (pos < PROMPT_LEN + lengths.unsqueeze(1))
    entropy = torch.rand(b, S, generator=g) * 3.0
    entropy = torch.where(response_mask, entropy, torch.full_like(entropy, 100.0))
    return rewards, group_ids, entropy, response_mask


@pytest.fixture(scope="module")
def batch():
    return make_batch()


def group_rows(group_ids: torch.Tensor):
    """{id: ascending LongTensor of its rows}"""
    return {int(i): (group_ids == i).nonzero().flatten() for i in torch.unique(group_ids)}


def ref_grpo(rewards, group_ids, eps=1e-6):
    """Slow GRPO advantages: one Python loop per group, unbiased std."""
    out = torch.zeros(rewards.numel(), dtype=torch.float64)
    for rows in group_rows(group_ids).values():
        r = [float(rewards[i]) for i in rows]
        if max(r) == min(r):
            continue
        m = sum(r) / len(r)
        sd = math.sqrt(sum((x - m) ** 2 for x in r) / (len(r) - 1))
        for i, x in zip(rows.tolist(), r):
            out[i] = (x - m) / (sd + eps)
    return out


def ref_top_tokens(adv_kept, entropy, mask, k):
    """Slow batch-scope top-k: (|A| x H in float32, flat index) sorted, highest first."""
    cand = []
    for b in range(mask.shape[0]):
        for s in range(mask.shape[1]):
            if mask[b, s]:
                score = float(adv_kept[b].to(torch.float32).abs() * entropy[b, s].to(torch.float32))
                cand.append((-score, b * mask.shape[1] + s))
    cand.sort()
    keep = torch.zeros(mask.numel(), dtype=torch.bool)
    for _, flat in cand[:k]:
        keep[flat] = True
    return keep.view(mask.shape)


def expected_tokens(k_frac: float, n_eligible: int, floor: int = 0) -> int:
    # The decimal K as typed (0.05, 0.125, 0.2), exactly: ceil(K x n), raised to the floor
    # (all of the pool when it holds fewer).
    return max(math.ceil(Fraction(repr(k_frac)) * n_eligible), min(floor, n_eligible))


def selector(name: str, **overrides) -> D3SSelector:
    return D3SSelector(D3SConfig.from_preset(name, **overrides))


# ----------------------------------------------------------------------------- all presets


def test_preset_table():
    assert set(PRESETS) == set(PRESET_NAMES)
    needs = {n: D3SSelector(PRESETS[n]).needs_entropy for n in PRESET_NAMES}
    assert needs == {
        "grpo": False,
        "pods": False,
        "d1s": False,
        "d1s_cross": False,
        "d2s": True,
        "d3s": True,
        "d3s_i": True,
    }


@pytest.mark.parametrize("name", PRESET_NAMES)
@pytest.mark.parametrize("progress", PROGRESS)
def test_every_preset_runs_and_masks_are_consistent(batch, name, progress):
    rewards, group_ids, entropy, mask = batch
    sel = selector(name)
    stage, tok = sel.apply(rewards, group_ids, entropy, mask, progress)
    assert isinstance(stage, SampleStage) and isinstance(tok, TokenStage)
    b = rewards.numel()
    assert stage.sample_keep.shape == (b,) and stage.sample_keep.dtype == torch.bool
    assert torch.equal(stage.kept_rows, stage.sample_keep.nonzero().flatten())
    assert stage.advantages.shape == (b,) and stage.advantages.dtype == torch.float32
    kept_mask = mask[stage.kept_rows]
    assert tok.token_keep.shape == kept_mask.shape and tok.token_keep.dtype == torch.bool
    assert not (tok.token_keep & ~kept_mask).any()  # only eligible tokens of kept rows
    assert stage.metrics["n_degenerate_groups"] == len(DEGENERATE)
    assert stage.metrics["all_degenerate"] == 0.0 and not stage.all_degenerate
    for key in ("kept_sample_ratio", "kept_adv_var", "share_nonzero_adv"):
        assert key in stage.metrics
    for key in ("kept_token_ratio", "samples_without_tokens", "n_kept_tokens", "n_eligible_tokens"):
        assert key in tok.metrics
    # Full-group advantages come first: every rule except pods leaves them untouched.
    full = compute_advantages(rewards, group_ids).advantages
    if name != "pods":
        assert torch.equal(stage.advantages, full)


def test_grpo_keeps_everything(batch):
    rewards, group_ids, entropy, mask = batch
    stage, tok = selector("grpo").apply(rewards, group_ids, None, mask, 0.3)
    assert stage.sample_keep.all()
    assert torch.allclose(stage.advantages.double(), ref_grpo(rewards, group_ids), atol=1e-6)
    assert torch.equal(tok.token_keep, mask)
    assert tok.k_frac == 1.0 and stage.n_keep == 1.0
    assert stage.metrics["kept_sample_ratio"] == 1.0
    assert tok.metrics["kept_token_ratio"] == 1.0
    assert "mean_entropy_kept" not in tok.metrics  # no entropy was computed


@pytest.mark.parametrize("progress", PROGRESS)
def test_pods_renormalises_on_the_kept_subset(batch, progress):
    rewards, group_ids, entropy, mask = batch
    stage, tok = selector("pods").apply(rewards, group_ids, None, mask, progress)
    m = resolve_n_keep(0.25, G)
    assert m == 2
    full = compute_advantages(rewards, group_ids).advantages
    for rows in group_rows(group_ids).values():
        want = rows[max_variance_subset(rewards[rows], m)]
        assert torch.equal(
            stage.sample_keep[rows].nonzero().flatten(),
            (rows[..., None] == want).any(1).nonzero().flatten(),
        )
        r = [float(rewards[i]) for i in want]
        mean = sum(r) / len(r)
        sd = math.sqrt(sum((x - mean) ** 2 for x in r) / (len(r) - 1))
        for i, x in zip(want.tolist(), r):
            ref = 0.0 if max(r) == min(r) else (x - mean) / (sd + 1e-4)
            assert stage.advantages[i].item() == pytest.approx(ref, abs=1e-6)
        dropped = rows[~stage.sample_keep[rows]]
        assert torch.equal(stage.advantages[dropped], full[dropped])
    assert torch.equal(tok.token_keep, mask[stage.kept_rows])


@pytest.mark.parametrize("zat", ["keep", "drop"])
def test_tokens_of_zero_advantage_rollouts_are_kept_or_dropped_as_configured(zat):
    """Hand-worked: 4 prompts x G = 4, rewards [1,0,0,0 | 0,0,0,0 | 1,1,1,1 | 0,0,0,0], D3S-I
    keeps N = 2 of each group: rows 0, 1 (A != 0) and two of each all-equal group (A = 0);
    10 response tokens a row, entropy 1, batch scope, K = 0.75. "keep": 60 of the 80 tokens,
    only rows 0 and 1's 20 with a gradient, so the kept normaliser is 60; "drop": the pool is
    those 20, 15 kept, and every kept token carries a gradient."""
    rewards = torch.tensor([1.0, 0, 0, 0] + [0.0] * 4 + [1.0] * 4 + [0.0] * 4)
    group_ids = torch.arange(4).repeat_interleave(4)
    sel = D3SSelector(
        D3SConfig(
            sample_rule="d3s_intra",
            token_scope="batch",
            schedule=DynamicSchedule("constant", 0.5, 0.5, 0.75, 0.75),
            zero_advantage_tokens=zat,
        )
    )
    stage = sel.select_samples(rewards, group_ids, 0.0)
    assert stage.kept_rows.tolist()[:2] == [0, 1] and len(stage.kept_rows) == 8
    mask = torch.zeros(8, 12, dtype=torch.bool)
    mask[:, 2:] = True
    tok = sel.select_tokens(stage, torch.ones(8, 12), mask, 0.0)
    informative = (stage.kept_advantages != 0).unsqueeze(1) & tok.token_keep
    if zat == "keep":
        assert int(tok.token_keep.sum()) == 60 and int(informative.sum()) == 20
        assert tok.metrics["n_eligible_tokens"] == 80
    else:
        assert int(tok.token_keep.sum()) == 15 and torch.equal(informative, tok.token_keep)
        assert tok.metrics["n_eligible_tokens"] == 20
    with pytest.raises(ValueError, match="zero_advantage_tokens"):
        D3SConfig(zero_advantage_tokens="maybe")


def test_pods_renormalises_with_the_configured_estimator(batch):
    """d3s.advantage reached the full-group advantages only; PODS re-normalised its kept
    subset with GRPO's whatever was configured."""
    rewards, group_ids, _, mask = batch
    stage, _ = selector("pods", advantage="dr_grpo").apply(rewards, group_ids, None, mask, 0.0)
    for rows in group_rows(group_ids).values():
        kept = rows[stage.sample_keep[rows]]
        mean = float(rewards[kept].double().mean())
        for i in kept.tolist():
            assert stage.advantages[i].item() == pytest.approx(float(rewards[i]) - mean, abs=1e-6)


@pytest.mark.parametrize("name", ("d1s", "d3s_i"))
@pytest.mark.parametrize("progress", PROGRESS)
def test_intra_group_presets_keep_n_per_prompt(batch, name, progress):
    rewards, group_ids, entropy, mask = batch
    sel = selector(name)
    stage = sel.select_samples(rewards, group_ids, progress)
    m = resolve_n_keep(sel.n_keep_at(progress), G)
    full = compute_advantages(rewards, group_ids).advantages
    for rows in group_rows(group_ids).values():
        kept = rows[stage.sample_keep[rows]]
        assert kept.numel() == m
        assert torch.equal(kept, torch.sort(rows[max_variance_subset(full[rows], m)]).values)
    assert stage.metrics["n_kept_samples"] == m * N_GROUPS


def ref_pool_max_variance(values, m):
    """Independent of the production selector: rows of the exact max-variance m-subset of a
    pool. Candidates are the lemma's (k largest + m - k smallest of the sorted pool, equal
    values in index order); each candidate's sum of squared deviations is computed in exact
    rational arithmetic, so mathematical ties are exact; among tied candidates (the documented
    rule) those whose sum is closest to m x the pool's mean, then the side of the pool's first
    value (above the mean: the largest k, else the smallest); m = 1 keeps the value farthest
    from the mean (lower index on ties); within a run of equal values the lowest indices."""
    if m == 1 and len(values) > 1:
        mean = Fraction(sum(Fraction(v) for v in values)) / len(values)
        dev = [abs(Fraction(v) - mean) for v in values]
        return [dev.index(max(dev))]
    order = sorted(range(len(values)), key=lambda i: (values[i], i))
    exact = [Fraction(values[i]) for i in order]
    pool_mean = sum(exact) / len(exact)

    def ss(k):
        part = exact[: m - k] + exact[len(exact) - k :]
        mean = sum(part) / m
        return sum((x - mean) ** 2 for x in part)

    def off(k):
        return abs(sum(exact[: m - k] + exact[len(exact) - k :]) - m * pool_mean)

    scores = [ss(k) for k in range(m + 1)]
    tied = [k for k in range(m + 1) if scores[k] == max(scores)]
    centred = [k for k in tied if off(k) == min(off(j) for j in tied)]
    k = centred[-1] if Fraction(values[0]) > pool_mean else centred[0]
    kept_values = sorted(values[i] for i in order[: m - k] + order[len(order) - k :])
    rows = []
    for v in sorted(set(kept_values)):
        rows += [i for i, x in enumerate(values) if x == v][: kept_values.count(v)]
    return sorted(rows)


# Rollouts kept per prompt (G = 8) at progress 0 / 0.5 / 1, by hand from the presets: d1s_cross
# and d2s keep G/4; d3s moves linearly from G/8 to G/2 (at 0.5: 2.5 -> 3, rounded half up).
CROSS_PER_PROMPT = {"d1s_cross": (2, 2, 2), "d2s": (2, 2, 2), "d3s": (1, 3, 4)}


@pytest.mark.parametrize("name", ("d1s_cross", "d2s", "d3s"))
@pytest.mark.parametrize("progress", PROGRESS)
def test_cross_group_presets_select_from_the_pool(batch, name, progress):
    """The pooled rule against references that share no code with it: GRPO advantages by a
    per-group loop, the count from the preset table by hand, the subset by exact arithmetic."""
    rewards, group_ids, entropy, mask = batch
    stage = selector(name).select_samples(rewards, group_ids, progress)
    full = ref_grpo(rewards, group_ids)
    torch.testing.assert_close(
        stage.advantages.double(), full, rtol=1e-6, atol=1e-6
    )  # never re-normalised
    m_total = CROSS_PER_PROMPT[name][PROGRESS.index(progress)] * N_GROUPS
    assert stage.kept_rows.tolist() == ref_pool_max_variance(stage.advantages.tolist(), m_total)


@pytest.mark.parametrize("name", ("d2s", "d3s", "d3s_i"))
@pytest.mark.parametrize("progress", PROGRESS)
@pytest.mark.parametrize(
    "floor", (None, 0, 20)
)  # the preset's own (256 binds on this small batch), none, one in between
def test_batch_scope_token_count_and_ranking(batch, name, progress, floor):
    rewards, group_ids, entropy, mask = batch
    sel = selector(name) if floor is None else selector(name, min_kept_tokens=floor)
    stage, tok = sel.apply(rewards, group_ids, entropy, mask, progress)
    kept_mask = mask[stage.kept_rows]
    n_eligible = int(kept_mask.sum())
    k = expected_tokens(sel.k_frac_at(progress), n_eligible, sel.cfg.min_kept_tokens)
    assert int(tok.token_keep.sum()) == k
    ref = ref_top_tokens(stage.kept_advantages, entropy[stage.kept_rows], kept_mask, k)
    assert torch.equal(tok.token_keep, ref)


def test_d3s_follows_the_schedule_endpoints(batch):
    rewards, group_ids, entropy, mask = batch
    sel = selector("d3s", min_kept_tokens=0)  # the schedule's K itself (the floor: test above)
    cases = {0.0: (0.125, 1, 0.05), 0.5: (0.3125, 3, 0.125), 1.0: (0.5, 4, 0.2)}
    for p, (n_frac, per_prompt, k) in cases.items():
        assert sel.n_keep_at(p) == pytest.approx(n_frac)
        assert sel.k_frac_at(p) == pytest.approx(k)
        stage, tok = sel.apply(rewards, group_ids, entropy, mask, p)
        assert stage.n_keep == pytest.approx(n_frac) and tok.k_frac == pytest.approx(k)
        assert stage.kept_rows.numel() == per_prompt * N_GROUPS
        n_eligible = int(mask[stage.kept_rows].sum())
        assert int(tok.token_keep.sum()) == expected_tokens(k, n_eligible, sel.cfg.min_kept_tokens)


@pytest.mark.parametrize("name", PRESET_NAMES + ("random",))
@pytest.mark.parametrize("progress", PROGRESS)
def test_apply_equals_two_stage_path(batch, name, progress):
    rewards, group_ids, entropy, mask = batch
    if name == "random":
        sel = D3SSelector(
            D3SConfig(
                sample_rule="random",
                token_scope="sample",
                schedule=DynamicSchedule("linear", 0.25, 0.75, 0.1, 0.3),
                seed=3,
            )
        )
    else:
        sel = selector(name)
    stage, tok = sel.apply(rewards, group_ids, entropy, mask, progress)
    stage2 = sel.select_samples(rewards, group_ids, progress)
    rows = stage2.kept_rows
    tok2 = sel.select_tokens(
        stage2, entropy[rows] if sel.needs_entropy else None, mask[rows], progress
    )
    assert torch.equal(stage.sample_keep, stage2.sample_keep)
    assert torch.equal(stage.advantages, stage2.advantages)
    assert torch.equal(tok.token_keep, tok2.token_keep)
    assert stage.metrics == stage2.metrics
    assert {k: v for k, v in tok.metrics.items() if "entropy" not in k} == {
        k: v for k, v in tok2.metrics.items() if "entropy" not in k
    }


def test_metrics_match_references(batch):
    rewards, group_ids, entropy, mask = batch
    stage, tok = selector("d3s", min_kept_tokens=0).apply(rewards, group_ids, entropy, mask, 0.5)
    b = rewards.numel()
    kept_adv = stage.advantages[stage.kept_rows].double()
    m = stage.metrics
    assert m["kept_sample_ratio"] == pytest.approx(stage.kept_rows.numel() / b)
    assert m["kept_adv_var"] == pytest.approx(float(kept_adv.var(correction=1)))
    assert m["kept_adv_var"] >= 1.0  # the D3S bound (unbiased variance)
    assert m["share_nonzero_adv"] == pytest.approx(float((kept_adv != 0).double().mean()))
    assert m["n_informative_groups"] == N_GROUPS - len(DEGENERATE)
    keep, km, h = tok.token_keep, mask[stage.kept_rows], entropy[stage.kept_rows].double()
    t = tok.metrics
    assert t["n_eligible_tokens"] == int(km.sum()) and t["n_kept_tokens"] == int(keep.sum())
    assert t["kept_token_ratio"] == pytest.approx(int(keep.sum()) / int(km.sum()))
    assert t["mean_entropy_kept"] == pytest.approx(float(h[keep].mean()))
    assert t["mean_entropy_eligible"] == pytest.approx(float(h[km].mean()))
    assert t["mean_entropy_kept"] < 100.0  # no padding position was scored
    assert t["samples_without_tokens"] == int((km.any(1) & ~keep.any(1)).sum())
    assert t["samples_without_tokens"] > 0  # K = 12.5% (no floor) leaves whole samples out here
    assert t["samples_without_eligible"] == int((~km.any(1)).sum())


def test_random_rule_is_reproducible(batch):
    rewards, group_ids, _, _ = batch
    cfg = D3SConfig(
        sample_rule="random", schedule=DynamicSchedule("constant", 0.25, 0.25, 1.0, 1.0), seed=7
    )
    a = D3SSelector(cfg).select_samples(rewards, group_ids, 0.25)
    b = D3SSelector(cfg).select_samples(rewards, group_ids, 0.25)
    assert torch.equal(a.sample_keep, b.sample_keep)
    for rows in group_rows(group_ids).values():
        assert int(a.sample_keep[rows].sum()) == 2


# ----------------------------------------------------------------------------- hand-worked


def test_hand_worked_d3s_two_groups_of_four():
    """2 prompts x 4 rollouts, binary rewards, eps = 0 so the numbers are exact.

    group A (rows 0-3) rewards 1 0 0 0: mean 1/4, unbiased std sqrt(0.75/3) = 1/2
        -> A = 1.5, -0.5, -0.5, -0.5
    group B (rows 4-7) rewards 1 1 0 0: mean 1/2, unbiased std sqrt(1/3)
        -> A = +-(1/2) sqrt(3) = +-0.8660
    N = 1 per prompt -> 2 rollouts from the pool of 8 with maximal Var(A):
        k=0 (two smallest -0.866, -0.866): 0;  k=2 (1.5, 0.866): 0.201;
        k=1 (1.5 and -0.866): (1.5 + 0.866)^2 / 2 = 2.799  -> rows 0 and 6 (6 < 7: lower index)
    Tokens (S = 4, position 0 = prompt): row 0 eligible 1..3, row 6 eligible 1..2.
        H row 0 = [9, 0.2, 0.8, 0.4] -> |A| H = [-, 0.3, 1.2, 0.6]
        H row 6 = [9, 0.6, 0.45, 9]  -> |A| H = [-, 0.5196, 0.3897, -]
    K = 0.5 of 5 eligible -> ceil(2.5) = 3 tokens: 1.2 (0,2), 0.6 (0,3), 0.5196 (6,1).
    By entropy alone (6,2) (H 0.45) would beat (0,3) (H 0.4); |A| decides it.
    """
    rewards = torch.tensor([1.0, 0, 0, 0, 1, 1, 0, 0])
    group_ids = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    cfg = D3SConfig(
        sample_rule="d3s_cross",
        token_scope="batch",
        eps=0.0,
        schedule=DynamicSchedule("constant", 1, 1, 0.5, 0.5),
    )
    sel = D3SSelector(cfg)
    stage = sel.select_samples(rewards, group_ids, 0.0)
    h3 = math.sqrt(3) / 2
    assert stage.advantages.tolist() == pytest.approx(
        [1.5, -0.5, -0.5, -0.5, h3, h3, -h3, -h3], abs=1e-6
    )
    assert stage.kept_rows.tolist() == [0, 6]
    assert stage.kept_advantages.tolist() == pytest.approx([1.5, -h3], abs=1e-6)
    assert stage.metrics["kept_adv_var"] == pytest.approx((1.5 + h3) ** 2 / 2, abs=1e-5)  # 2.7990
    assert stage.metrics["share_nonzero_adv"] == 1.0
    assert stage.metrics["kept_sample_ratio"] == 0.25

    entropy = torch.full((8, 4), 9.0)
    entropy[0] = torch.tensor([9.0, 0.2, 0.8, 0.4])
    entropy[6] = torch.tensor([9.0, 0.6, 0.45, 9.0])
    mask = torch.zeros(8, 4, dtype=torch.bool)
    mask[:, 1:] = True
    mask[6, 3] = False  # padding
    scores = sel.token_scores(stage, entropy[stage.kept_rows], mask[stage.kept_rows])
    want = torch.tensor([[0, 0.3, 1.2, 0.6], [0, 0.6 * h3, 0.45 * h3, 0]])
    torch.testing.assert_close(scores, want, atol=1e-6, rtol=0)
    stage2, tok = sel.apply(rewards, group_ids, entropy, mask, 0.0)
    assert tok.token_keep.tolist() == [[False, False, True, True], [False, True, False, False]]
    assert tok.metrics["n_eligible_tokens"] == 5 and tok.metrics["n_kept_tokens"] == 3
    assert tok.metrics["kept_token_ratio"] == pytest.approx(0.6)
    assert tok.metrics["mean_entropy_kept"] == pytest.approx((0.8 + 0.4 + 0.6) / 3)
    assert tok.metrics["mean_entropy_eligible"] == pytest.approx((0.2 + 0.8 + 0.4 + 0.6 + 0.45) / 5)
    assert tok.metrics["samples_without_tokens"] == 0

    # A floor of 4 tokens per step raises K from 0.5 to 4/5: the next-best token (0,1) (0.3)
    # loses to (6,2) (0.3897), so the four are 1.2, 0.6, 0.5196, 0.3897.
    floored = D3SSelector(dataclasses.replace(cfg, min_kept_tokens=4))
    _, tok4 = floored.apply(rewards, group_ids, entropy, mask, 0.0)
    assert tok4.token_keep.tolist() == [[False, False, True, True], [False, True, True, False]]
    assert tok4.k_frac == pytest.approx(0.8) and tok4.metrics["k_frac_schedule"] == 0.5
    # A floor below K x eligible (3 tokens) changes nothing.
    _, tok2 = D3SSelector(dataclasses.replace(cfg, min_kept_tokens=2)).apply(
        rewards, group_ids, entropy, mask, 0.0
    )
    assert torch.equal(tok2.token_keep, tok.token_keep) and tok2.k_frac == 0.5

    # Intra-group with N = 1: every single rollout has variance 0; the rule keeps the one
    # farthest from its group's mean: group A's 1.5 (row 0), group B's +-0.866 tie -> row 4
    # (lower index). (The max-variance tie-break alone would keep the minima, rows 1 and 6:
    # negative advantages only.)
    intra = D3SSelector(
        D3SConfig(
            sample_rule="d3s_intra", eps=0.0, schedule=DynamicSchedule("constant", 1, 1, 1.0, 1.0)
        )
    )
    assert intra.select_samples(rewards, group_ids, 0.0).kept_rows.tolist() == [0, 4]


# ----------------------------------------------------------------------------- edge cases


def test_all_degenerate_batch_is_flagged_not_an_error():
    rewards = torch.tensor([1.0] * 4 + [0.0] * 4 + [0.5] * 4)
    group_ids = torch.arange(3).repeat_interleave(4)
    mask = torch.ones(12, 5, dtype=torch.bool)
    entropy = torch.rand(12, 5, generator=torch.Generator().manual_seed(1))
    sel = selector("d3s")
    stage, tok = sel.apply(rewards, group_ids, entropy, mask, 1.0)
    assert stage.all_degenerate
    assert stage.metrics["all_degenerate"] == 1.0
    assert stage.metrics["n_informative_groups"] == 0.0
    assert stage.metrics["share_nonzero_adv"] == 0.0 and stage.metrics["kept_adv_var"] == 0.0
    assert (stage.advantages == 0).all()
    # Still a well-formed, deterministic selection (the caller skips the update).
    assert stage.kept_rows.numel() == 2 * 3
    assert int(tok.token_keep.sum()) == expected_tokens(0.2, int(mask[stage.kept_rows].sum()), 256)


def test_no_eligible_token_gives_an_empty_mask():
    rewards = torch.tensor([1.0, 0, 1, 0])
    group_ids = torch.tensor([0, 0, 1, 1])
    mask = torch.zeros(4, 3, dtype=torch.bool)
    for name in ("d3s", "grpo"):
        stage, tok = selector(name).apply(rewards, group_ids, torch.ones(4, 3), mask, 0.0)
        assert not tok.token_keep.any()
        assert tok.metrics["n_kept_tokens"] == 0 and tok.metrics["kept_token_ratio"] == 0.0
        assert tok.metrics["samples_without_eligible"] == stage.kept_rows.numel()


def test_scope_all_reports_entropy_when_given(batch):
    rewards, group_ids, entropy, mask = batch
    stage, tok = selector("d1s").apply(rewards, group_ids, entropy, mask, 0.0)
    km = mask[stage.kept_rows]
    assert torch.equal(tok.token_keep, km)
    assert tok.metrics["mean_entropy_kept"] == pytest.approx(
        float(entropy[stage.kept_rows][km].double().mean())
    )


# ----------------------------------------------------------------------------- errors


def test_unknown_preset_lists_names():
    with pytest.raises(ValueError) as e:
        D3SConfig.from_preset("d4s")
    assert "d4s" in str(e.value)
    for name in PRESET_NAMES:
        assert name in str(e.value)


def test_bad_config_values():
    with pytest.raises(ValueError, match="d3s_cross"):
        D3SConfig(sample_rule="d3s_crosss")
    with pytest.raises(ValueError, match="batch"):
        D3SConfig(token_scope="global")
    with pytest.raises(ValueError, match="advantage"):
        D3SConfig(advantage="ppo")
    with pytest.raises(ValueError, match="eps"):
        D3SConfig(eps=-1.0)
    with pytest.raises(ValueError, match="renorm_eps"):
        D3SConfig(renorm_eps=float("nan"))
    with pytest.raises(ValueError, match="unknown D3SConfig field"):
        D3SConfig.from_preset("d3s", n_keep=4)
    with pytest.raises(ValueError, match="k_init"):
        D3SConfig(schedule={"kind": "linear", "k_init": 0.0})
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="min_kept_tokens"):
            D3SConfig(min_kept_tokens=bad)


def test_from_preset_returns_an_independent_copy():
    cfg = D3SConfig.from_preset("d3s", seed=5)
    cfg.schedule.n_init = 0.3
    assert PRESETS["d3s"].schedule.n_init == 0.125 and PRESETS["d3s"].seed == 0


def test_entropy_errors(batch):
    rewards, group_ids, entropy, mask = batch
    sel = selector("d3s")
    stage = sel.select_samples(rewards, group_ids, 0.5)
    rows = stage.kept_rows
    with pytest.raises(ValueError, match="entropy is required"):
        sel.select_tokens(stage, None, mask[rows], 0.5)
    with pytest.raises(ValueError, match="entropy has shape"):
        sel.select_tokens(stage, entropy[rows][:, :-1], mask[rows], 0.5)
    with pytest.raises(ValueError, match="entropy has shape"):
        sel.select_tokens(stage, entropy, mask[rows], 0.5)  # all rows instead of the kept ones
    with pytest.raises(ValueError, match="floating-point"):
        sel.select_tokens(stage, entropy[rows].long(), mask[rows], 0.5)
    with pytest.raises(ValueError, match="entropy is required"):
        sel.apply(rewards, group_ids, None, mask, 0.5)
    with pytest.raises(ValueError, match="entropy has shape"):
        sel.apply(rewards, group_ids, entropy[:, :-1], mask, 0.5)
    with pytest.raises(ValueError, match="entropy has shape"):
        sel.apply(rewards, group_ids, entropy[:-1], mask, 0.5)


def test_mask_and_progress_errors(batch):
    rewards, group_ids, entropy, mask = batch
    sel = selector("d3s")
    stage = sel.select_samples(rewards, group_ids, 0.5)
    rows = stage.kept_rows
    with pytest.raises(ValueError, match="rows but"):
        sel.select_tokens(stage, entropy[rows], mask, 0.5)
    with pytest.raises(ValueError, match="bool"):
        sel.select_tokens(stage, entropy[rows], mask[rows].long(), 0.5)
    with pytest.raises(ValueError, match="2-D"):
        sel.select_tokens(stage, entropy[rows][:, 0], mask[rows][:, 0], 0.5)
    with pytest.raises(ValueError, match="response_mask has"):
        sel.apply(rewards, group_ids, entropy[:-1], mask[:-1], 0.5)
    with pytest.raises(ValueError, match="progress"):
        sel.select_samples(rewards, group_ids, 1.5)
    with pytest.raises(ValueError, match="D3SConfig"):
        D3SSelector("d3s")


# ----------------------------------------------------------------------------- configs


def test_structured_config_round_trip(batch):
    omegaconf = pytest.importorskip("omegaconf")
    OmegaConf = omegaconf.OmegaConf

    @dataclass
    class Root:
        d3s: D3SConfig = field(default_factory=lambda: D3SConfig.from_preset("d3s"))
        baseline: Optional[D3SConfig] = None

    cfg = OmegaConf.structured(Root)
    assert cfg.d3s.schedule.kind == "linear" and cfg.d3s.renorm_eps is None and cfg.baseline is None
    cfg = OmegaConf.merge(
        cfg,
        OmegaConf.from_dotlist(
            [
                "d3s.schedule.n_init=2",
                "d3s.schedule.n_final=6",
                "d3s.renorm_eps=0.001",
                "d3s.schedule.kind=step",
                "d3s.schedule.kwargs={milestones: [0.25, 0.75]}",
            ]
        ),
    )
    obj = OmegaConf.to_object(cfg)
    assert isinstance(obj.d3s, D3SConfig) and isinstance(obj.d3s.schedule, DynamicSchedule)
    assert obj.d3s.schedule.at(0.5) == (4, pytest.approx(0.125))
    rewards, group_ids, entropy, mask = batch
    from_dc = D3SSelector(cfg.d3s)  # a DictConfig works directly
    from_obj = D3SSelector(obj.d3s)
    s1, t1 = from_dc.apply(rewards, group_ids, entropy, mask, 0.5)
    s2, t2 = from_obj.apply(rewards, group_ids, entropy, mask, 0.5)
    assert s1.kept_rows.numel() == 4 * N_GROUPS
    assert torch.equal(s1.sample_keep, s2.sample_keep) and torch.equal(t1.token_keep, t2.token_keep)
    bad = OmegaConf.merge(OmegaConf.structured(Root), {"d3s": {"sample_rule": "nope"}})
    with pytest.raises(Exception, match="known"):
        OmegaConf.to_object(bad)


def test_mapping_config():
    sel = D3SSelector(
        {"sample_rule": "d3s_intra", "schedule": {"kind": "constant", "n_init": 2, "n_final": 2}}
    )
    assert sel.cfg.schedule.n_is_count and sel.n_keep_at(0.7) == 2 and sel.k_frac_at(0.7) == 1.0


# ----------------------------------------------------------------------------- package


def test_core_package_exports_and_stays_light():
    code = (
        "import sys, json, nemo_d3s.core as c\n"
        "mods = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('megatron', 'transformers', 'vllm', 'omegaconf', 'hydra') "
        "or m.startswith(('nemo_d3s.distributed', 'nemo_d3s.backends', 'nemo_d3s.trainer')))\n"
        "print(json.dumps({'all': c.__all__, 'heavy': mods}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    info = json.loads(out.stdout.strip().splitlines()[-1])
    assert info["heavy"] == []
    import nemo_d3s.core as core

    assert len(info["all"]) == len(set(info["all"]))
    for module in (
        "advantages",
        "sample_selection",
        "schedules",
        "token_selection",
        "entropy",
        "losses",
        "d3s",
    ):
        mod = getattr(core, module)
        for name in mod.__all__:
            assert name in info["all"] and getattr(core, name) is getattr(mod, name)
    for name in (
        "D3SSelector",
        "D3SConfig",
        "PRESETS",
        "compute_advantages",
        "max_variance_subset",
        "DynamicSchedule",
        "select_tokens",
        "token_scores",
        "entropy_and_logprobs",
        "Registry",
    ):
        assert name in info["all"]
    # Source-level: no core module imports torch.distributed or a model framework.
    from pathlib import Path

    for path in Path(core.__file__).parent.glob("*.py"):
        text = path.read_text()
        for bad in (
            "import torch.distributed",
            "from torch.distributed",
            "torch.distributed.",
            "import megatron",
            "from megatron",
            "import transformers",
        ):
            assert bad not in text, f"{path.name} contains {bad!r}"
