"""core.routing: expert sets compared without their order, the mismatch counted over a mask,
and the replayed top-k scores, each against a hand-worked case and a slow loop."""

from __future__ import annotations

import torch

from nemo_d3s.core.routing import (
    NO_EXPERT,
    expert_sets_differ,
    replay_topk_scores,
    routing_mismatch_counts,
)


def test_expert_sets_differ_ignores_order_within_the_top_k():
    # [2 tokens, 2 layers, K = 2]
    a = torch.tensor([[[0, 3], [1, 2]], [[0, 3], [1, 2]]])
    b = torch.tensor([[[3, 0], [2, 1]], [[0, 3], [1, 3]]])  # token 0: same sets; token 1: no
    assert expert_sets_differ(a, b).tolist() == [False, True]


def test_mismatch_counts_by_hand_and_against_a_loop():
    # B = 1, S = 4, L = 1, K = 2: positions 0 (prompt, masked out), 1 same, 2 differs, 3 never
    # fed back by the engine (NO_EXPERT): 1 of 2 compared tokens differs
    engine = torch.tensor([[[[0, 1]], [[2, 3]], [[0, 2]], [[NO_EXPERT, NO_EXPERT]]]])
    trainer = torch.tensor([[[[1, 2]], [[3, 2]], [[0, 1]], [[0, 1]]]])
    mask = torch.tensor([[False, True, True, True]])
    assert routing_mismatch_counts(engine, trainer, mask) == (1, 2)
    g = torch.Generator().manual_seed(0)
    E, K = 6, 2
    engine = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(3 * 5 * 4)])
    trainer = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(3 * 5 * 4)])
    engine, trainer = engine.view(3, 5, 4, K), trainer.view(3, 5, 4, K)
    trainer[0] = engine[0]  # one row agrees everywhere
    mask = torch.rand(3, 5, generator=g) < 0.7
    differ = total = 0
    for b in range(3):
        for s in range(5):
            if mask[b, s]:
                total += 1
                differ += any(
                    set(engine[b, s, layer].tolist()) != set(trainer[b, s, layer].tolist())
                    for layer in range(4)
                )
    assert routing_mismatch_counts(engine, trainer, mask) == (differ, total)


def test_replayed_scores_by_hand():
    probs = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
    target = torch.tensor([[0, 2]])
    assert torch.allclose(replay_topk_scores(probs, target, False), torch.tensor([[0.1, 0.3]]))
    assert torch.allclose(replay_topk_scores(probs, target, True), torch.tensor([[0.25, 0.75]]))
    # the router's own top-k replayed gives its own scores
    own = probs.topk(2, dim=-1)
    assert torch.equal(replay_topk_scores(probs, own.indices, False), own.values)
