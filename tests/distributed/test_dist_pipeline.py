"""Pipeline parallel: per-token results from the last stage reach every stage (TP2 x PP2).

Megatron groups TP2 x PP2 on 4 gloo ranks (and TP2 x PP2 x DP2 on 8: ~4 s once the fork server is
warm). Only the last stage holds the vocab-sharded logits of each micro-batch (micro-batches have
different [B_i, S_i]); it runs ``logprob_loss_func`` as Megatron's schedule would, then
``broadcast_per_token`` ships all micro-batches' entropy and log-probs to the first stage in one
broadcast. Every stage then runs the same DP-global token selection and denominator on its own DP
group. The parent checks: identical tensors on all stages and TP ranks, equal to the single-process
reference (core entropy on the full logits, core top-k on the whole batch, core loss_denominator);
bool masks broadcast from the last stage arrive intact.
"""

from __future__ import annotations

import pytest
import torch

from _launch import run_ranks
from _limits import WAIT_S  # noqa: E402

pytestmark = pytest.mark.distributed

V_PAD, V_REAL = 10, 9
SHAPES = [(2, 5), (3, 4)]
TEMPERATURES = [1.0, 0.7]  # per micro-batch: scored as softmax(logits / T)


def _micro_batch(dp_rank, i):
    g = torch.Generator().manual_seed(10 * dp_rank + i)
    b, s = SHAPES[i]
    logits = torch.randn(b, s, V_PAD, generator=g) * 2
    targets = torch.randint(0, V_REAL, (b, s), generator=g)
    eligible = torch.rand(b, s, generator=g) < 0.8
    return logits, targets, eligible


def _rank_pipeline(rank):
    from megatron.core import parallel_state as ps

    from nemo_d3s.distributed import (
        PerTokenStore,
        broadcast_from_last_stage,
        broadcast_per_token,
        global_loss_denominator,
        is_last_stage,
        logprob_loss_func,
        select_tokens_global,
    )

    tp, pp, dp = (
        ps.get_tensor_model_parallel_group(),
        ps.get_pipeline_model_parallel_group(),
        ps.get_data_parallel_group(),
    )
    tp_rank, dp_rank = ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_rank()
    last = is_last_stage(pp)
    assert last == ps.is_pipeline_last_stage()
    store = PerTokenStore() if last else None
    if last:  # what the schedule does on the last stage, micro-batch by micro-batch
        for i in range(len(SHAPES)):
            logits, targets, _ = _micro_batch(dp_rank, i)
            shard = logits[..., tp_rank * V_PAD // 2 : (tp_rank + 1) * V_PAD // 2]
            loss, logs = logprob_loss_func(
                store, targets, tp, vocab_size=V_REAL, temperature=TEMPERATURES[i]
            )(shard.transpose(0, 1).contiguous().transpose(0, 1))
            assert float(loss) == 0.0 and logs == {}
    per_mb = broadcast_per_token(store, SHAPES, pp)
    entropy = [mb["entropy"] for mb in per_mb]
    logprobs = [mb["logprobs"] for mb in per_mb]
    eligible = [_micro_batch(dp_rank, i)[2] for i in range(len(SHAPES))]
    # Token selection over the whole step: pad micro-batches to a common S for one [B, S] pool.
    s_max = max(s for _, s in SHAPES)
    pad = lambda x, v: torch.nn.functional.pad(x, (0, s_max - x.shape[1]), value=v)  # noqa: E731
    scores = torch.cat([pad(e, 0.0) for e in entropy])
    elig = torch.cat([pad(e, False) for e in eligible])
    keep = select_tokens_global(scores, elig, 0.3, dp).token_keep
    denom = global_loss_denominator(keep, "token_mean", dp)
    # Or: the last stage decides and broadcasts the mask (bool travels as uint8).
    keep_last = broadcast_from_last_stage(keep if last else None, keep.shape, torch.bool, pp)
    return dict(
        stage=ps.get_pipeline_model_parallel_rank(),
        dp=dp_rank,
        tp=tp_rank,
        entropy=entropy,
        logprobs=logprobs,
        keep=keep,
        denom=denom,
        keep_last=keep_last,
    )


def _check(results, dp_size):
    from nemo_d3s.core.entropy import entropy_and_logprobs
    from nemo_d3s.core.token_selection import top_k_mask, n_tokens_to_keep

    assert {r["stage"] for r in results} == {0, 1}
    s_max = max(s for _, s in SHAPES)
    pools = []
    for d in range(dp_size):
        ent, elig = [], []
        for i in range(len(SHAPES)):
            logits, targets, eligible = _micro_batch(d, i)
            e, lp = entropy_and_logprobs(logits[..., :V_REAL], targets, temperature=TEMPERATURES[i])
            for r in (r for r in results if r["dp"] == d):
                torch.testing.assert_close(r["entropy"][i], e, rtol=1e-5, atol=1e-6)
                torch.testing.assert_close(r["logprobs"][i], lp, rtol=1e-5, atol=1e-6)
            ent.append(torch.nn.functional.pad(e, (0, s_max - e.shape[1])))
            elig.append(
                torch.nn.functional.pad(eligible, (0, s_max - eligible.shape[1]), value=False)
            )
        pools.append((torch.cat(ent), torch.cat(elig)))
    # Reference selection on the DP-concatenated batch, using the values the ranks hold.
    got_scores = {
        d: torch.cat(
            [
                torch.nn.functional.pad(e, (0, s_max - e.shape[1]))
                for e in next(r for r in results if r["dp"] == d)["entropy"]
            ]
        )
        for d in range(dp_size)
    }
    cat_s = torch.cat([got_scores[d] for d in range(dp_size)])
    cat_e = torch.cat([p[1] for p in pools])
    k = n_tokens_to_keep(int(cat_e.sum()), 0.3)
    ref_keep = top_k_mask(cat_s, cat_e, k).split([p[1].shape[0] for p in pools])
    first = {}
    for r in results:
        assert torch.equal(r["keep"], ref_keep[r["dp"]]), r["stage"]
        assert torch.equal(r["keep_last"], r["keep"])
        assert r["denom"] == float(k)
        key = r["dp"]
        if key in first:  # every stage and TP rank of a replica holds identical tensors
            assert all(torch.equal(a, b) for a, b in zip(first[key]["entropy"], r["entropy"]))
        first.setdefault(key, r)


def test_tp2_pp2_broadcast():
    _check(run_ranks(_rank_pipeline, 4, tp=2, pp=2), dp_size=1)


def test_tp2_pp2_dp2_broadcast_and_selection():
    _check(run_ranks(_rank_pipeline, 8, tp=2, pp=2, timeout=WAIT_S), dp_size=2)


def test_single_stage_is_identity():
    from nemo_d3s.distributed import (
        PerTokenStore,
        broadcast_from_last_stage,
        broadcast_per_token,
        logprob_loss_func,
    )

    logits, targets, _ = _micro_batch(0, 0)
    store = PerTokenStore()
    logprob_loss_func(store, targets, None, vocab_size=V_REAL, seq_first=True)(
        logits.transpose(0, 1)
    )
    out = broadcast_per_token(store, [SHAPES[0]], None)
    assert torch.equal(out[0]["entropy"], store.micro_batches[0]["entropy"])
    x = torch.ones(2, dtype=torch.bool)
    assert broadcast_from_last_stage(x, (2,), torch.bool, None) is x
    with pytest.raises(ValueError, match="micro-batch results"):
        broadcast_per_token(store, SHAPES, None)
