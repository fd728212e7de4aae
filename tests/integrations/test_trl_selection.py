"""The TRL plugin's selection glue, without TRL (runs in the main environment): TRL's global
groups, the whole-batch sample selection equal to the core's, the DP-global version on 2
gloo ranks equal to 1 process, the batch cut, and the version refusal."""

from __future__ import annotations

import pytest
import torch

from nemo_d3s.core.presets import D3SConfig
from nemo_d3s.core.sample_selection import select_samples
from nemo_d3s.core.token_selection import k_frac_with_floor, token_scores, top_k_batch
from nemo_d3s.distributed.launch import run_on_gloo_ranks
from nemo_d3s.errors import ConfigError, RunError
from nemo_d3s.integrations.trl.selection import (
    TRLD3SSelector,
    compact_rows,
    kept_batch,
    neutral_unscorable,
    step_shares,
    trl_group_ids,
)
from nemo_d3s.versions import ALLOW_ENV, check_stack
from _limits import WAIT_S  # noqa: E402


def _trl_advantages(rewards: torch.Tensor, g: int) -> torch.Tensor:
    """TRL 1.16's default advantages (scale_rewards="group"), written out slowly:
    (r - group mean) / (unbiased group std + 1e-4)."""
    out = torch.empty_like(rewards)
    for start in range(0, rewards.numel(), g):
        r = rewards[start : start + g]
        out[start : start + g] = (r - r.mean()) / (r.std(correction=1) + 1e-4)
    return out


# Hand-worked: 2 prompts x G = 4. Group 0 rewards [1, 0, 0, 0]: mean 1/4, std 1/2, A =
# [0.75, -0.25 x 3] / 0.5001. Group 1 [1, 1, 0, 0]: mean 1/2, std sqrt(1/3), A = +-0.5 / 0.57745.
REWARDS = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0])
ADV = _trl_advantages(REWARDS, 4)


def test_hand_worked_advantages_and_groups():
    assert ADV[0] == pytest.approx(0.75 / 0.5001, rel=1e-6)
    assert ADV[6] == pytest.approx(-0.5 / (3**-0.5 + 1e-4), rel=1e-6)
    assert trl_group_ids(8, 4).tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    with pytest.raises(ConfigError, match="num_generations"):
        trl_group_ids(6, 4)


def test_d1s_cross_hand_worked_rows():
    # N = 1/4 of G = 1 per prompt -> 2 rollouts from the pool of 8, the max-variance pair: the
    # largest advantage (row 0, +1.4997) and the smallest (-0.8659; rows 6 and 7 tie, the
    # lower index wins).
    sel = TRLD3SSelector(D3SConfig.from_preset("d1s_cross"), None)
    stage, keep_all = sel.select_whole(REWARDS, ADV, 4, slice(0, 8), 0.0)
    assert keep_all.nonzero().flatten().tolist() == [0, 6]
    assert stage.kept_rows.tolist() == [0, 6]
    torch.testing.assert_close(stage.advantages, ADV)  # D3S never re-normalises
    # the second process's slice is rows 4..7 of the same selection
    stage1, _ = sel.select_whole(REWARDS, ADV, 4, slice(4, 8), 0.0)
    assert stage1.kept_rows.tolist() == [2]


@pytest.mark.parametrize("preset", ["grpo", "pods", "d1s", "d1s_cross", "d2s", "d3s", "d3s_i"])
def test_whole_batch_selection_equals_the_core(preset):
    g = torch.Generator().manual_seed(3)
    rewards = torch.randint(0, 3, (24,), generator=g).float()
    adv = _trl_advantages(rewards, 6)
    cfg = D3SConfig.from_preset(preset)
    sel = TRLD3SSelector(cfg, None)
    stage, keep_all = sel.select_whole(rewards, adv, 6, slice(0, 24), 0.5)
    ref = select_samples(
        cfg.sample_rule, rewards, adv, trl_group_ids(24, 6), sel.n_keep_at(0.5), eps=cfg.renorm_eps
    )
    assert torch.equal(keep_all, ref.sample_keep)
    torch.testing.assert_close(stage.advantages, ref.advantages)


def test_unscorable_rollouts_stand_at_their_groups_mean_and_keep_advantage_zero():
    nan = float("nan")
    rewards = torch.tensor([1.0, 1.0, 1.0, nan, 0.0, 1.0, nan, 4.0, nan, nan, nan, nan])
    filled, unscorable = neutral_unscorable(rewards, 4)
    # hand-worked: group 1's scored mean is (0 + 1 + 4) / 3 = 5/3; group 2 is scored nowhere
    want = [1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 5 / 3, 4.0, 0.0, 0.0, 0.0, 0.0]
    assert filled.tolist() == pytest.approx(want)
    assert unscorable.tolist() == [False] * 3 + [True] + [False] * 2 + [True, False] + [True] * 4
    same, none = neutral_unscorable(REWARDS, 4)
    assert same is REWARDS and not none.any()
    # PODS keeps 3 of group 1 by reward variance. At 5/3: {0, 1, 4} (variance 13/3) beats
    # {0, 5/3, 4} (4.04). As a 0 the unscorable one was an extreme: {0, 0, 4} (16/3) kept it,
    # with a non-zero re-normalised advantage
    adv = _trl_advantages(filled, 4)
    adv[unscorable] = 0.0  # TRL's
    pods = D3SConfig.from_preset("pods", schedule={"n_init": 0.75, "n_final": 0.75})
    stage, keep = TRLD3SSelector(pods, None).select_whole(rewards, adv, 4, slice(0, 12), 0.0)
    assert keep[4:8].tolist() == [True, True, False, True]
    assert stage.advantages[unscorable].tolist() == [0.0] * 6
    # group 0 (1, 1, 1 and an unscorable) is all-equal for D3S as it is for TRL
    assert stage.advantage_result.n_degenerate == 2  # groups 0 and 2


def test_token_stage_equals_the_core_top_k():
    cfg = D3SConfig.from_preset("d3s", min_kept_tokens=0)
    sel = TRLD3SSelector(cfg, None)
    stage, _ = sel.select_whole(REWARDS, ADV, 4, slice(0, 8), 1.0)  # N = 1/2: 4 rollouts
    g = torch.Generator().manual_seed(0)
    rows = stage.kept_rows
    entropy = torch.rand(rows.numel(), 10, generator=g)
    mask = torch.rand(rows.numel(), 10, generator=g) > 0.3
    tok = sel.select_tokens(stage, entropy, mask, 1.0)
    assert tok.k_frac == pytest.approx(0.2)
    ref = top_k_batch(token_scores(ADV[rows], entropy, mask), mask, 0.2)
    assert torch.equal(tok.token_keep, ref)
    # the preset's floor of 256 tokens keeps all of a pool this small
    sel256 = TRLD3SSelector(D3SConfig.from_preset("d3s"), None)
    tok256 = sel256.select_tokens(stage, entropy, mask, 1.0)
    assert k_frac_with_floor(0.2, int(mask.sum()), 256) == 1.0
    assert torch.equal(tok256.token_keep, mask)


def _rank(rank, preset):
    import torch.distributed as dist

    sel = TRLD3SSelector(D3SConfig.from_preset(preset, min_kept_tokens=0), dist.group.WORLD)
    return _select(sel, slice(4 * rank, 4 * rank + 4))


def _select(sel, rows):
    stage, keep_all = sel.select_whole(REWARDS, ADV, 4, rows, 0.6)
    g = torch.Generator().manual_seed(1)
    entropy_all = torch.rand(8, 6, generator=g)
    mask_all = torch.rand(8, 6, generator=g) > 0.2
    kept = stage.kept_rows + rows.start
    tok = sel.select_tokens(stage, entropy_all[kept], mask_all[kept], 0.6)
    return {"rows": kept.tolist(), "tokens": tok.token_keep.tolist(), "all": keep_all.tolist()}


@pytest.mark.distributed
@pytest.mark.parametrize("preset", ["d3s", "d3s_i", "pods"])
def test_two_ranks_select_what_one_process_selects(preset):
    one = _select(
        TRLD3SSelector(D3SConfig.from_preset(preset, min_kept_tokens=0), None), slice(0, 8)
    )
    two = run_on_gloo_ranks(_rank, 2, preset, timeout=WAIT_S)
    assert two[0]["all"] == two[1]["all"] == one["all"]
    assert two[0]["rows"] + two[1]["rows"] == one["rows"]
    assert two[0]["tokens"] + two[1]["tokens"] == one["tokens"]


def _batch(b=4, p=3, c=5):
    ids = torch.arange(b).unsqueeze(1) * 100
    cmask = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 0, 0, 0, 0]])
    return {
        "prompt_ids": ids.expand(b, p).clone(),
        "prompt_mask": torch.ones(b, p, dtype=torch.long),
        "completion_ids": (ids + torch.arange(c)).clone(),
        "completion_mask": cmask[:b, :c],
        "advantages": torch.arange(b).float(),
        "num_items_in_batch": torch.tensor(10),
    }


def test_kept_batch_cuts_rows_masks_tokens_and_trims():
    batch = _batch()
    keep = torch.tensor([[0, 1, 0, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.bool)  # rows 1 and 3
    out, n_pad = kept_batch(batch, torch.tensor([1, 3]), keep, min_rows=1, trim_columns=True)
    assert n_pad == 0
    assert out["prompt_ids"][:, 0].tolist() == [100, 300]
    assert out["advantages"].tolist() == [1.0, 3.0]
    # widest kept completion is row 1's 3 tokens: columns 3.. are dropped
    assert out["completion_ids"].tolist() == [[100, 101, 102], [300, 301, 302]]
    assert out["tool_mask"].tolist() == [[0, 1, 0], [1, 0, 0]]
    assert out["num_items_in_batch"] is batch["num_items_in_batch"]


def test_kept_batch_pads_with_zero_loss_rows_and_refuses_unknown_keys():
    batch = _batch()
    batch["tool_mask"] = torch.ones(4, 5, dtype=torch.long)
    batch["tool_mask"][2, 0] = 0
    keep = torch.ones(3, 5, dtype=torch.bool)
    out, n_pad = kept_batch(batch, torch.tensor([0, 1, 2]), keep, min_rows=2, trim_columns=False)
    assert n_pad == 1 and out["prompt_ids"].shape[0] == 4
    assert out["tool_mask"][3].sum() == 0  # the placeholder adds nothing to the loss
    assert out["tool_mask"][2, 0] == 0  # the old tool mask is kept
    empty, n_pad = kept_batch(
        _batch(),
        torch.zeros(0, dtype=torch.long),
        torch.zeros(0, 5, dtype=torch.bool),
        min_rows=2,
        trim_columns=True,
    )
    assert n_pad == 2 and empty["tool_mask"].sum() == 0
    # another process kept 5: every process pads to the same rows (a multiple of min_rows)
    out, n_pad = kept_batch(
        batch, torch.tensor([0, 1, 2]), keep, min_rows=2, trim_columns=False, rows_over_processes=5
    )
    assert n_pad == 3 and out["prompt_ids"].shape[0] == 6
    assert out["tool_mask"][3:].sum() == 0 and out["prompt_ids"][3:, 0].tolist() == [0, 0, 0]
    batch["pixel_values"] = torch.zeros(4, 3)
    with pytest.raises(ConfigError, match="pixel_values"):
        kept_batch(batch, torch.tensor([0]), keep[:1], min_rows=1, trim_columns=True)


def test_compact_rows_cuts_after_the_last_loss_token():
    batch = _batch()
    # loss tokens: row 0 col 1, row 2 col 2; rows 1 and 3 have none (row 1 has completion)
    batch["tool_mask"] = torch.tensor(
        [[0, 1, 0, 0, 0], [0, 0, 0, 0, 0], [1, 0, 1, 0, 0], [0, 0, 0, 0, 0]]
    )
    batch["old_per_token_logps"] = torch.arange(20.0).view(4, 5)
    batch["importance_sampling_ratio"] = torch.ones(4, 5)
    out, before, after = compact_rows(batch, drop_rows=True)
    assert out["advantages"].tolist() == [0.0, 2.0]  # rows 0 and 2
    assert out["completion_ids"].tolist() == [[0, 1, 2], [200, 201, 202]]
    assert out["old_per_token_logps"].tolist() == [[0.0, 1.0, 2.0], [10.0, 11.0, 12.0]]
    assert out["importance_sampling_ratio"].shape == (2, 3)
    assert out["prompt_ids"].shape == (2, 3)  # the prompt side is never cut
    assert out["num_items_in_batch"] is batch["num_items_in_batch"]
    assert (before, after) == (4 * (3 + 5), 2 * (3 + 3))
    # rows kept where the loss counts them; the width rounded up to a multiple
    out, _, after = compact_rows(batch, drop_rows=False, multiple=4)
    assert out["completion_ids"].shape == (4, 4) and after == 4 * (3 + 4)
    # vespo: a per-token ratio keeps its columns up to the last completion token (row 2's 4th)
    out, _, _ = compact_rows(batch, drop_rows=True, ratio_columns=False)
    assert out["completion_ids"].shape == (2, 4)
    # no loss token at all: row 0 stays, one column, so the backward still runs
    batch["tool_mask"] = torch.zeros(4, 5, dtype=torch.long)
    asked = []
    out, _, after = compact_rows(batch, drop_rows=True, equal_rows=lambda n: asked.append(n) or n)
    assert out["completion_ids"].tolist() == [[0]] and after == 1 * (3 + 1)
    assert asked == [1]  # the kept count other processes are told: row 0


def test_compact_rows_pads_to_the_rows_another_process_keeps():
    batch = _batch()
    batch["tool_mask"] = torch.tensor(
        [[0, 1, 0, 0, 0], [0, 0, 0, 0, 0], [1, 0, 1, 0, 0], [0, 0, 0, 0, 0]]
    )
    asked = []
    out, before, after = compact_rows(
        batch, drop_rows=True, equal_rows=lambda n: asked.append(n) or 3
    )
    assert asked == [2]  # this process keeps 2 rows; another keeps 3
    # rows 0 and 2, then a copy of row 0 that carries no loss token
    assert out["advantages"].tolist() == [0.0, 2.0, 0.0]
    assert out["tool_mask"].tolist() == [[0, 1, 0], [1, 0, 1], [0, 0, 0]]
    assert out["completion_mask"][2].tolist() == out["completion_mask"][0].tolist()
    assert (before, after) == (4 * (3 + 5), 3 * (3 + 3))
    # enough rows already, or rows not dropped: nothing added
    kept = compact_rows(batch, drop_rows=True, equal_rows=lambda n: n)[0]
    assert kept["advantages"].tolist() == [0.0, 2.0]
    # rows not dropped: every process holds its whole micro-batch, nobody is asked
    out = compact_rows(batch, drop_rows=False, equal_rows=lambda n: asked.append(n) or 9)[0]
    assert out["completion_ids"].shape[0] == 4 and asked == [2]
    # no tool mask: the copies get one, zero on them alone
    del batch["tool_mask"]
    out, _, _ = compact_rows(batch, drop_rows=True, equal_rows=lambda n: 5)
    assert out["tool_mask"].sum(1).tolist()[-1] == 0 and out["completion_ids"].shape[0] == 5


def test_step_shares():
    assert step_shares(8, 2, 40.0, 5.0) == {
        "kept_sample_share": 0.25,
        "kept_token_share": 0.125,
        "update_tokens": 5.0,
    }


def test_trl_version_range_and_override(monkeypatch):
    monkeypatch.delenv(ALLOW_ENV, raising=False)
    assert check_stack(["trl"], {"trl": "1.16.0"}) == []
    assert check_stack(["trl"], {"trl": "1.16.3.dev0"}) == []
    for bad in ("1.17.0", "0.19.1", "2.0.0"):
        with pytest.raises(RunError, match=f"trl {bad} is installed.*{ALLOW_ENV}=1"):
            check_stack(["trl"], {"trl": bad})
    monkeypatch.setenv(ALLOW_ENV, "1")
    assert check_stack(["trl"], {"trl": "1.17.0"}) == [
        "trl 1.17.0 is installed, tested: >=1.16,<1.17"
    ]
