"""Mixture-of-experts routing of rollouts: which experts each token went through, compared
between the engine that sampled it and the trainer that scores it, and the trainer's router
forced to the engine's choice (router replay). Pure tensors.

Shapes: ``experts`` [B, S, L, K] integer (token-aligned like the batch: position t holds the
K experts each of the L MoE layers routed token t's input to; -1 where nothing was routed,
e.g. padding or a sampled token the engine never fed back); router probabilities [N, E]
float over the N tokens of one layer's forward.
"""

from __future__ import annotations

from typing import Tuple

import torch

__all__ = [
    "NO_EXPERT",
    "ROUTER_REPLAY",
    "expert_sets_differ",
    "routing_mismatch_counts",
    "replay_topk_scores",
]

NO_EXPERT = -1  # a position with no routing recorded
# algorithm.router_replay: the trainer's own routing | the engine's (rollout routing replay)
ROUTER_REPLAY = ("none", "rollout")


def expert_sets_differ(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[..., L, K] x [..., L, K] -> [...] bool: some layer's set of K experts differs (the
    order within the top-k does not count: the engine and the trainer may rank two experts
    with nearly equal scores differently and still route the token through both)."""
    if a.shape != b.shape:
        raise ValueError(f"routing shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    sa, _ = torch.sort(a, dim=-1)
    sb, _ = torch.sort(b, dim=-1)
    return (sa != sb).flatten(-2).any(dim=-1)


def routing_mismatch_counts(
    engine: torch.Tensor, trainer: torch.Tensor, mask: torch.Tensor
) -> Tuple[int, int]:
    """(tokens whose expert sets differ in some layer, tokens compared) over the positions of
    ``mask`` [B, S] bool where both recorded a routing (no ``NO_EXPERT``)."""
    both = mask & (engine >= 0).all(-1).all(-1) & (trainer >= 0).all(-1).all(-1)
    differ = expert_sets_differ(engine, trainer) & both
    return int(differ.sum()), int(both.sum())


def replay_topk_scores(
    probs: torch.Tensor, target: torch.Tensor, renormalise: bool
) -> torch.Tensor:
    """The top-k scores a router gives when its experts are ``target`` [N, K] rather than
    its own top-k of ``probs`` [N, E]: the probabilities of those experts, renormalised over
    the K when the architecture renormalises its top-k; differentiable in ``probs`` (the
    router still learns from the tokens it is made to route)."""
    scores = probs.gather(-1, target.long())
    if renormalise:
        scores = scores / scores.sum(dim=-1, keepdim=True)
    return scores
