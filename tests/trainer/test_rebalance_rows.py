"""trainer.update.rebalance_rows on 2 gloo ranks: every kept row ends up on exactly one rank
with all its tensors (a mixture of experts' routing to replay included), an empty rank gets
work (or a zero-weight pad when there is only one row), and the token imbalance does not
grow."""

from __future__ import annotations

import pytest
import torch

from nemo_d3s.distributed.launch import run_on_gloo_ranks
from _limits import WAIT_S  # noqa: E402

pytestmark = pytest.mark.distributed


def _rows(rank, n_rows):
    """Rank 0 holds ``n_rows`` rows of different lengths, rank 1 none (what cross-group
    selection can produce). Row i's ids are all 100 * (i + 1), so rows are identifiable."""
    from nemo_d3s.backends.base import TokenBatch
    from nemo_d3s.trainer.update import UpdateBatch

    n = n_rows if rank == 0 else 0
    S = 7
    lengths = torch.tensor([7, 3, 5, 2, 6][:n], dtype=torch.long)
    ids = (100 * (torch.arange(n) + 1)).unsqueeze(1).expand(n, S).clone()
    attn = torch.arange(S).unsqueeze(0) < lengths.unsqueeze(1)
    resp = attn.clone()
    resp[:, 0] = False
    keep = resp.clone()
    # [n, S, L=2, K=2]: row i routes every token to experts (i, i + 1) in both layers
    routed = torch.stack([torch.arange(n), torch.arange(n) + 1], -1).to(torch.int16)
    routed = routed[:, None, None, :].expand(n, S, 2, 2).clone()
    return UpdateBatch(
        batch=TokenBatch(ids, attn, resp, routed),
        old_logprobs=-ids.float() / 1000,
        advantages=torch.arange(n).float(),
        token_keep=keep,
        minibatch=torch.zeros(n, dtype=torch.long),
        denominators=torch.zeros(1, dtype=torch.float64),
    )


def _rank(rank, n_rows):
    import torch.distributed as dist

    from nemo_d3s.distributed.groups import ParallelGroups
    from nemo_d3s.trainer.update import rebalance_rows

    groups = ParallelGroups(dp=dist.group.WORLD, global_rank=rank)
    out, stats = rebalance_rows(_rows(rank, n_rows), groups)
    return {
        "ids": out.batch.input_ids[:, 0].tolist(),
        "tokens": out.batch.attention_mask.sum(1).tolist(),
        "kept": out.token_keep.sum(1).tolist(),
        "adv": out.advantages.tolist(),
        "old_ok": bool(
            torch.equal(
                out.old_logprobs * out.batch.attention_mask,
                (-out.batch.input_ids.float() / 1000) * out.batch.attention_mask,
            )
        ),
        "routing_ok": bool(
            (
                out.batch.routed_experts[:, :, :, 0] == out.batch.input_ids[:, :, None] // 100 - 1
            ).all()
        ),
        "stats": stats,
    }


def test_rows_move_whole_and_empty_rank_gets_work():
    res = run_on_gloo_ranks(_rank, 2, 5, timeout=WAIT_S)
    ids = sorted(res[0]["ids"] + res[1]["ids"])
    assert ids == [100, 200, 300, 400, 500]  # each row on exactly one rank
    assert res[0]["ids"] and res[1]["ids"]
    for r in res:
        for i, adv in zip(r["ids"], r["adv"]):
            assert adv == i // 100 - 1  # the advantage travelled with its row
        assert r["old_ok"] and r["routing_ok"]
        assert r["kept"] == [t - 1 for t in r["tokens"]]  # loss masks intact
    assert res[0]["stats"] == res[1]["stats"]
    # 23 tokens: LPT gives {7, 5} and {6, 3, 2} -> max 12 of mean 11.5
    assert res[0]["stats"]["dp_imbalance_before"] == pytest.approx(2.0)
    assert res[0]["stats"]["dp_imbalance_after"] == pytest.approx(12 / 11.5)


def test_a_single_row_leaves_a_zero_weight_pad():
    res = run_on_gloo_ranks(_rank, 2, 1, timeout=WAIT_S)
    assert res[0]["ids"] == [100] and res[1]["ids"] == [100]  # rank 1 runs a copy ...
    assert res[0]["kept"] == [6] and res[1]["kept"] == [0]  # ... that carries no loss token
