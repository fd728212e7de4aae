"""The D3S/PODS math over explicit process groups (callers take them from
``megatron.core.parallel_state``); None or a one-rank group falls back to the core function. Nothing
here imports Megatron."""

from nemo_d3s.distributed.launch import run_on_gloo_ranks
from nemo_d3s.distributed.normalizers import (
    StepNormalizer,
    global_loss_denominator,
    step_normalizer,
)
from nemo_d3s.distributed.pipeline import (
    PerTokenStore,
    broadcast_from_last_stage,
    broadcast_per_token,
    is_last_stage,
    logprob_loss_func,
    train_loss_func,
)
from nemo_d3s.distributed.rebalance import (
    RebalancedBatch,
    RebalancePlan,
    apply_rebalance,
    plan_from_tokens,
    plan_rebalance,
)
from nemo_d3s.distributed.sample_selection import (
    GlobalSampleSelection,
    gather_batch_groups,
    global_select_samples,
)
from nemo_d3s.distributed.topk import (
    DISTRIBUTED_TOKEN_SCOPES,
    GlobalTokenSelection,
    global_top_k_mask,
    select_tokens_global,
)
from nemo_d3s.distributed.vocab_parallel import (
    vocab_parallel_entropy_and_logprobs,
    vocab_shard_range,
)

__all__ = [
    "run_on_gloo_ranks",
    # vocab-parallel entropy / log-probs
    "vocab_parallel_entropy_and_logprobs",
    "vocab_shard_range",
    # token top-K%
    "global_top_k_mask",
    "select_tokens_global",
    "GlobalTokenSelection",
    "DISTRIBUTED_TOKEN_SCOPES",
    # sample selection + rebalancing
    "global_select_samples",
    "gather_batch_groups",
    "GlobalSampleSelection",
    "plan_rebalance",
    "plan_from_tokens",
    "apply_rebalance",
    "RebalancePlan",
    "RebalancedBatch",
    # loss normalisation
    "global_loss_denominator",
    "step_normalizer",
    "StepNormalizer",
    # pipeline parallel
    "is_last_stage",
    "broadcast_from_last_stage",
    "broadcast_per_token",
    "logprob_loss_func",
    "train_loss_func",
    "PerTokenStore",
    # the DP-global D3S selector (lazy: needs core.d3s)
    "DistributedD3SSelector",
]


def __getattr__(name):
    if name == "DistributedD3SSelector":
        from nemo_d3s.distributed.selector import DistributedD3SSelector

        return DistributedD3SSelector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
