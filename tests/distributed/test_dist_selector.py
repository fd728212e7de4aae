"""DistributedD3SSelector on 2 ranks == core D3SSelector on the concatenated batch.

Each rank holds whole prompt groups with global prompt ids (as the trainer builds them);
the d3s preset (cross-group sample selection, batch token scope) is applied at one
progress value. Sample masks, advantages and token masks must equal the single-process
selector's, split by rank (exact: same deterministic core functions on the same values).
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


def _cfg():
    from nemo_d3s.core.d3s import D3SConfig

    return D3SConfig.from_preset("d3s")


def _rank_selector(rank):
    import torch.distributed as dist

    from nemo_d3s.distributed import DistributedD3SSelector

    rewards, gids, entropy, response_mask = _batch(rank)
    sel = DistributedD3SSelector(_cfg(), dist.group.WORLD)
    stage = sel.select_samples(rewards, gids, PROGRESS)
    rows = stage.kept_rows
    tok = sel.select_tokens(stage, entropy[rows], response_mask[rows], PROGRESS)
    return stage.sample_keep, stage.advantages, tok.token_keep


def test_matches_single_process_selector():
    from nemo_d3s.core.d3s import D3SSelector

    results = run_ranks(_rank_selector, 2, megatron=False)
    parts = [_batch(r) for r in range(2)]
    rewards, gids, entropy, response_mask = (torch.cat(x) for x in zip(*parts))
    ref = D3SSelector(_cfg())
    stage = ref.select_samples(rewards, gids, PROGRESS)
    tok = ref.select_tokens(stage, entropy[stage.kept_rows], response_mask[stage.kept_rows], PROGRESS)
    counts = [p[0].numel() for p in parts]
    kept_counts = [int(k.sum()) for k in stage.sample_keep.split(counts)]
    for r, (keep, adv, token_keep) in enumerate(results):
        assert torch.equal(keep, stage.sample_keep.split(counts)[r])
        assert torch.equal(adv, stage.advantages.split(counts)[r])
        assert torch.equal(token_keep, tok.token_keep.split(kept_counts)[r])
    assert 0 < int(tok.token_keep.sum()) < int(response_mask[stage.kept_rows].sum())


def test_unknown_batch_scope_fails_at_construction():
    from nemo_d3s.distributed import DistributedD3SSelector

    with pytest.raises(ValueError, match="known: gather_quantile, global_exact, local"):
        DistributedD3SSelector(_cfg(), None, batch_scope="everything")
