"""End to end on Megatron tensor-parallel layers: TP2 x DP2 x micro-batches == one process.

A small causal LM built from megatron-core layers (VocabParallelEmbedding ->
ColumnParallelLinear -> gelu -> RowParallelLinear (+ residual) -> output
ColumnParallelLinear producing vocab-sharded logits, vocabulary padded 13 -> 16) runs the
whole D3S update on 4 gloo ranks:

1. old-policy pass through Megatron's real ``forward_backward_no_pipelining``
   (forward only) with ``pipeline.logprob_loss_func``: vocab-parallel entropy / log-probs,
   token-aligned;
2. token scores |A| x H and the DP-global exact top-40% (``select_tokens_global``);
3. the global loss denominator and ``StepNormalizer`` (``step_normalizer``);
4. the training pass through the same schedule (backward per micro-batch; the schedule
   divides each loss by the rank's number of micro-batches, which differs per rank here:
   2 and 3) with ``pipeline.train_loss_func`` (what the Megatron backend's train_step
   hands the schedule): vocab-parallel log-probs and the core GRPO loss SUM
   (``denominator=1``, as the trainer's loss closure computes it), scaled by
   ``normalizer.loss_scale``;
5. DDP's gradient averaging over DP (all-reduce SUM / dp_size, what Megatron's DDP does for
   ``calculate_per_token_loss=False``; Megatron's DDP wrapper itself needs CUDA buffers).

The parent rebuilds the model in one process with plain torch and the SAME full weights
(every layer's init_method is a seeded closure, so each rank builds the same master weight
and keeps its shard), runs the core single-process pipeline on the whole batch, and
compares token masks exactly and every parameter's full gradient (TP shards gathered) to
fp32 tolerance, for ``token_mean`` and ``seq_mean_token_mean``. Sizes are tiny, so
rtol/atol 1e-5 / 1e-7 leave a wide margin over fp32 summation-order noise (~1e-7 relative).
"""

from __future__ import annotations

import pytest
import torch

from _launch import run_ranks
from _limits import WAIT_S  # noqa: E402

pytestmark = pytest.mark.distributed

V_REAL, V_PAD, H, F, S = 13, 16, 8, 12, 7
K_FRAC = 0.4
SPLITS = {0: [2, 3], 1: [1, 1, 1]}  # rows per micro-batch on DP rank 0 (5 rows) and 1 (3 rows)
AGGS = ["token_mean", "seq_mean_token_mean"]
T = 0.8  # the rollouts' sampling temperature: every pass scores softmax(logits / T)


def _init(seed, std=0.4):
    def init(w):
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            w.copy_(torch.randn(w.shape, generator=g) * std)

    return init


def _data(dp_rank):
    g = torch.Generator().manual_seed(100 + dp_rank)
    b = sum(SPLITS[dp_rank])
    ids = torch.randint(0, V_REAL, (b, S), generator=g)
    resp_len = torch.randint(0, S - 1, (b,), generator=g)
    response_mask = (torch.arange(S) >= 2) & (torch.arange(S) < 2 + resp_len.unsqueeze(1))
    adv = torch.randn(b, generator=g)
    noise = 0.15 * torch.randn(b, S, generator=g)
    return ids, response_mask, adv, noise


def _rank_grads(rank):
    import torch.distributed as dist
    import torch.nn.functional as Fn
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel as mtp
    from megatron.core.enums import ModelType
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining

    from _megatron_cpu import patch_schedules_for_cpu, schedule_config
    from nemo_d3s.core.losses import LossConfig, policy_loss
    from nemo_d3s.core.token_selection import token_scores
    from nemo_d3s.distributed import (
        PerTokenStore,
        logprob_loss_func,
        select_tokens_global,
        step_normalizer,
        train_loss_func,
    )

    patch_schedules_for_cpu()
    tp, dp = ps.get_tensor_model_parallel_group(), ps.get_data_parallel_group()
    cfg = schedule_config(
        ModelParallelConfig(
            tensor_model_parallel_size=2, use_cpu_initialization=True, perform_initialization=True
        )
    )

    class TinyLM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config, self.model_type = cfg, ModelType.encoder_or_decoder
            self.embed = mtp.VocabParallelEmbedding(V_PAD, H, init_method=_init(1), config=cfg)
            self.fc1 = mtp.ColumnParallelLinear(
                H, F, config=cfg, init_method=_init(2), bias=True, gather_output=False
            )
            self.fc2 = mtp.RowParallelLinear(
                F,
                H,
                config=cfg,
                init_method=_init(3),
                bias=True,
                input_is_parallel=True,
                skip_bias_add=False,
            )
            self.head = mtp.ColumnParallelLinear(
                H, V_PAD, config=cfg, init_method=_init(4), bias=False, gather_output=False
            )

        def set_input_tensor(self, _):  # the schedule calls it; one stage, nothing to set
            pass

        def forward(self, ids):
            h = self.embed(ids)
            a, _ = self.fc1(h)
            o, _ = self.fc2(Fn.gelu(a))
            logits, _ = self.head(h + o)
            return logits  # [B, S, V_PAD / TP]

    model = TinyLM()
    ids, response_mask, adv, noise = _data(ps.get_data_parallel_rank())
    splits = SPLITS[ps.get_data_parallel_rank()]
    rows = list(torch.arange(ids.shape[0]).split(splits))

    # 1. old-policy pass (forward only) through Megatron's schedule
    store = PerTokenStore()

    def fwd_old(it, m):
        x = next(it)
        return m(x), logprob_loss_func(
            store, x, tp, token_aligned=True, vocab_size=V_REAL, chunk_size=3, temperature=T
        )

    forward_backward_no_pipelining(
        forward_step_func=fwd_old,
        data_iterator=iter([ids[r] for r in rows]),
        model=[model],
        num_microbatches=len(rows),
        seq_length=S,
        micro_batch_size=max(splits),
        forward_only=True,
    )
    entropy = torch.cat([mb["entropy"] for mb in store.micro_batches])  # token-aligned [B, S]
    old_lp = torch.cat([mb["logprobs"] for mb in store.micro_batches]) + noise

    # 2. DP-global exact token top-K%
    sel = select_tokens_global(token_scores(adv, entropy, response_mask), response_mask, K_FRAC, dp)
    token_keep = sel.token_keep
    out = {"token_keep": token_keep, "entropy": entropy, "dp_rank": ps.get_data_parallel_rank()}

    for agg in AGGS:
        # 3. global denominator, counted once per step
        norm = step_normalizer([token_keep[r] for r in rows], agg, dp, num_microbatches=len(rows))
        for p in model.parameters():
            p.grad = None

        def loss_sum(lp, r, agg=agg):
            return policy_loss(
                "grpo",
                lp,
                old_lp[r],
                adv[r],
                token_keep[r],
                cfg=LossConfig(aggregation=agg),
                denominator=1.0,
            )

        def fwd_train(it, m):
            r = next(it)
            attended = torch.ones_like(ids[r], dtype=torch.bool)  # no padding in these rows
            return m(ids[r]), train_loss_func(
                ids[r], attended, r, loss_sum, norm, tp, vocab_size=V_REAL, temperature=T
            )

        # 4. training pass: the schedule sums micro-batch gradients (after dividing by M)
        forward_backward_no_pipelining(
            forward_step_func=fwd_train,
            data_iterator=iter(rows),
            model=[model],
            num_microbatches=len(rows),
            seq_length=S,
            micro_batch_size=max(splits),
        )
        # 5. DDP: average gradients over the DP group
        grads = {}
        for name, p in model.named_parameters():
            g = p.grad.clone()
            dist.all_reduce(g, group=dp)
            g /= ps.get_data_parallel_world_size()
            if getattr(p, "tensor_model_parallel", False):
                parts = [torch.empty_like(g) for _ in range(2)]
                dist.all_gather(parts, g, group=tp)
                g = torch.cat(parts, dim=p.partition_dim)
            grads[name] = g
        out[agg] = (grads, norm.denominator)
    return out


def _reference(agg):
    """The same model and D3S update in one process on the whole batch (plain torch)."""
    import torch.nn.functional as Fn

    from nemo_d3s.core.entropy import align_to_tokens, entropy_and_logprobs
    from nemo_d3s.core.losses import LossConfig, loss_denominator, policy_loss
    from nemo_d3s.core.token_selection import select_tokens, token_scores

    w = {}
    for name, seed, shape in [
        ("embed.weight", 1, (V_PAD, H)),
        ("fc1.weight", 2, (F, H)),
        ("fc2.weight", 3, (H, F)),
        ("head.weight", 4, (V_PAD, H)),
    ]:
        w[name] = torch.empty(shape)
        _init(seed)(w[name])
    w["fc1.bias"], w["fc2.bias"] = torch.zeros(F), torch.zeros(H)
    for t in w.values():
        t.requires_grad_(True)
    parts = [_data(0), _data(1)]
    ids, response_mask, adv, noise = (torch.cat(x) for x in zip(*parts))

    def logits_of(x):
        h = w["embed.weight"][x]
        a = Fn.gelu(h @ w["fc1.weight"].T + w["fc1.bias"])
        return (h + a @ w["fc2.weight"].T + w["fc2.bias"]) @ w["head.weight"].T

    with torch.no_grad():
        ent, lp = entropy_and_logprobs(logits_of(ids)[:, :-1, :V_REAL] / T, ids[:, 1:])
    entropy, old_lp = align_to_tokens(ent), align_to_tokens(lp) + noise
    token_keep = select_tokens(
        token_scores(adv, entropy, response_mask), response_mask, K_FRAC, "batch"
    ).token_keep
    _, lp = entropy_and_logprobs(logits_of(ids)[:, :-1, :V_REAL] / T, ids[:, 1:])
    denom = loss_denominator(token_keep, agg)
    policy_loss(
        "grpo",
        align_to_tokens(lp),
        old_lp,
        adv,
        token_keep,
        cfg=LossConfig(aggregation=agg),
        denominator=denom,
    ).loss.backward()
    return token_keep, entropy, {k: t.grad for k, t in w.items()}, denom


@pytest.fixture(scope="module")
def results():
    return run_ranks(_rank_grads, 4, tp=2, timeout=WAIT_S)


def test_token_masks_match_single_process(results):
    token_keep, entropy, _, _ = _reference("token_mean")
    split = [sum(SPLITS[0]), sum(SPLITS[1])]
    for res in results:
        d = res["dp_rank"]
        assert torch.equal(res["token_keep"], token_keep.split(split)[d])
        torch.testing.assert_close(res["entropy"], entropy.split(split)[d], rtol=1e-5, atol=1e-6)
    assert 0 < int(token_keep.sum()) < int(torch.cat([_data(0)[1], _data(1)[1]]).sum())


@pytest.mark.parametrize("agg", AGGS)
def test_gradients_match_single_process(results, agg):
    _, _, ref_grads, ref_denom = _reference(agg)
    for res in results:
        grads, denom = res[agg]
        assert denom == ref_denom
        for name, ref in ref_grads.items():
            assert ref.abs().max() > 0, name  # every parameter really gets a gradient
            torch.testing.assert_close(grads[name], ref, rtol=1e-5, atol=1e-7, msg=f"{agg} {name}")
        # Padded vocabulary rows of the output layer get exactly zero gradient.
        assert not grads["head.weight"][V_REAL:].any()
