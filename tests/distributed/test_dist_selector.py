"""DistributedD3SSelector on 2 ranks == core D3SSelector on the concatenated batch.

Each rank holds whole prompt groups with global prompt ids (as the trainer builds them);
every preset is applied at one progress value (and D3S with a token floor that binds, whose
K comes from the whole batch's eligible count). Sample masks, advantages (PODS's
re-normalised ones included) and token masks must equal the single-process selector's,
split by rank, and the stages' metrics must be the whole batch's (exact: same
deterministic core functions on the same values).
"""

from __future__ import annotations

import pytest
import torch

from _launch import run_ranks

pytestmark = pytest.mark.distributed

G, S, PROGRESS = 8, 6, 0.3
PROMPTS = {0: [0, 1, 2], 1: [3, 4]}


def _batch(rank):
    g = torch.Generator().manual_seed(rank)
    gids = torch.tensor(PROMPTS[rank]).repeat_interleave(G)
    rewards = (torch.rand(gids.numel(), generator=g) < 0.4).float()
    entropy = torch.rand(gids.numel(), S, generator=g) * 3
    response_mask = torch.rand(gids.numel(), S, generator=g) < 0.8
    return rewards, gids, entropy, response_mask


PRESETS = [
    "grpo",
    "pods",
    "d1s",
    "d1s_cross",
    "d2s",
    "d3s",
    "d3s_i",
    "d3s_m0",
    "d3s_floor",
    "d3s_floor_sample",
]
# The floor binds here (K x eligible is ~5 tokens of ~45) and differs from what rank 1's own
# count (~18 eligible) would give, so a rank that used its local count would select otherwise.
FLOOR = 20


def _cfg(preset="d3s"):
    from nemo_d3s.core.d3s import D3SConfig

    if preset == "d3s_m0":  # the papers' rule: K alone
        return D3SConfig.from_preset("d3s", min_kept_tokens=0)
    if preset == "d3s_floor":
        return D3SConfig.from_preset("d3s", min_kept_tokens=FLOOR)
    if preset == "d3s_floor_sample":
        return D3SConfig.from_preset("d3s", min_kept_tokens=FLOOR, token_scope="sample")
    return D3SConfig.from_preset(preset)


def _rank_selector(rank):
    import torch.distributed as dist

    from nemo_d3s.distributed import DistributedD3SSelector

    rewards, gids, entropy, response_mask = _batch(rank)
    out = {}
    for preset in PRESETS:
        sel = DistributedD3SSelector(_cfg(preset), dist.group.WORLD)
        stage = sel.select_samples(rewards, gids, PROGRESS)
        rows = stage.kept_rows
        tok = sel.select_tokens(stage, entropy[rows], response_mask[rows], PROGRESS)
        out[preset] = (
            stage.sample_keep,
            stage.advantages,
            tok.token_keep,
            stage.metrics,
            tok.metrics,
        )
    return out


def test_matches_single_process_selector_for_every_preset():
    from nemo_d3s.core.d3s import D3SSelector

    results = run_ranks(_rank_selector, 2, megatron=False)
    parts = [_batch(r) for r in range(2)]
    rewards, gids, entropy, response_mask = (torch.cat(x) for x in zip(*parts))
    counts = [p[0].numel() for p in parts]
    for preset in PRESETS:
        ref = D3SSelector(_cfg(preset))
        stage = ref.select_samples(rewards, gids, PROGRESS)
        tok = ref.select_tokens(
            stage, entropy[stage.kept_rows], response_mask[stage.kept_rows], PROGRESS
        )
        kept_counts = [int(k.sum()) for k in stage.sample_keep.split(counts)]
        for r in range(2):
            keep, adv, token_keep, stage_metrics, tok_metrics = results[r][preset]
            assert torch.equal(keep, stage.sample_keep.split(counts)[r]), preset
            assert torch.equal(adv, stage.advantages.split(counts)[r]), preset
            assert torch.equal(token_keep, tok.token_keep.split(kept_counts)[r]), preset
            assert stage_metrics == stage.metrics, preset
            assert tok_metrics.keys() == tok.metrics.keys(), preset
            for k, v in tok.metrics.items():  # entropy sums add in another order across ranks
                assert tok_metrics[k] == pytest.approx(v, rel=1e-12), (preset, k)
        n_eligible = int(response_mask[stage.kept_rows].sum())
        if preset == "d3s_m0":
            assert 0 < int(tok.token_keep.sum()) < FLOOR < n_eligible
        if preset == "d3s_floor":  # exactly the floor, from the whole batch's count
            assert int(tok.token_keep.sum()) == FLOOR and tok.k_frac == FLOOR / n_eligible
        if preset == "d3s_floor_sample":  # per-row ceilings: at least the floor in all
            assert int(tok.token_keep.sum()) >= FLOOR
        if preset == "pods":  # the kept subset is re-normalised: advantages differ from the groups'
            assert not torch.equal(stage.advantages, stage.advantage_result.advantages)


def test_unknown_batch_scope_fails_at_construction():
    from nemo_d3s.distributed import DistributedD3SSelector

    with pytest.raises(ValueError, match="known: gather_quantile, global_exact, local"):
        DistributedD3SSelector(_cfg(), None, batch_scope="everything")
