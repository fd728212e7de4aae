"""The TRL plugin against TRL itself (marker ``trl``: needs trl installed; CI runs these in
their own environment, .ci/run; without trl the file is not collected, tests/conftest.py).

- preset ``grpo``: the plugin's generation batch, loss and gradients equal plain
  ``GRPOTrainer``'s on the same batch (same model, same seeds);
- a D3S preset: TRL's advantages are the selection's, the kept rows and tokens equal
  ``nemo_d3s.core``'s selection on those advantages and TRL's entropies, the entropies are
  the model's (computed here from its logits), the training forward sees the kept rows holding
  a kept token, up to the last kept column (compacted), and the gradient is that of
  -(1/N_kept) sum_{kept tokens} A log p, written out here;
- 2 processes (torchrun, gloo) keep the same rows and tokens as 1.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

trl = pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from nemo_d3s.backends.hf.config import TinyModelSpec  # noqa: E402
from nemo_d3s.backends.hf.loading import ensure_tiny_folder  # noqa: E402
from nemo_d3s.core.presets import D3SConfig  # noqa: E402
from nemo_d3s.core.sample_selection import select_samples  # noqa: E402
from nemo_d3s.core.token_selection import k_frac_with_floor, token_scores, top_k_batch  # noqa: E402
from nemo_d3s.integrations.trl import D3SGRPOTrainer  # noqa: E402
from nemo_d3s.integrations.trl.selection import trl_group_ids  # noqa: E402
from _limits import WAIT_S  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _trl_record import SelectionRecorder  # noqa: E402

pytestmark = pytest.mark.trl

G = 4
PROMPTS = [f"count to {i}" for i in range(4)]


class PlugRec(SelectionRecorder, D3SGRPOTrainer):
    pass


def _reward(completions, **kw):
    # varied, deterministic rewards on a random model's byte soup
    return [float(sum(map(ord, c)) % 5) for c in completions]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(ensure_tiny_folder(TinyModelSpec(), 0, cache=tmp_path_factory.mktemp("cache")))


def _trainer(cls, folder, out, config=None, **kw):
    args = GRPOConfig(
        **(config or {}),
        output_dir=str(out),
        use_cpu=True,
        per_device_train_batch_size=len(PROMPTS) * G,
        num_generations=G,
        max_completion_length=8,
        report_to="none",
        save_strategy="no",
        seed=0,
        bf16=False,  # float32 throughout, so the hand-written gradient below is comparable
    )
    trainer = cls(
        model=folder,
        reward_funcs=_reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        **kw,
    )
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # what Trainer's loop sets before a step
    return trainer


def _inputs():
    return [{"prompt": p} for p in PROMPTS for _ in range(G)]  # RepeatSampler's order


def _generate(trainer):
    torch.manual_seed(0)
    return trainer._generate_and_score_completions(copy.deepcopy(_inputs()))


def _loss_and_grads(trainer, batch):
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def test_grpo_preset_is_plain_trl(folder, tmp_path):
    plain = _trainer(GRPOTrainer, folder, tmp_path / "plain")
    plug = _trainer(D3SGRPOTrainer, folder, tmp_path / "plug", d3s="grpo")
    a, b = _generate(plain), _generate(plug)
    assert sorted(a) == sorted(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key
    loss_a, grads_a = _loss_and_grads(plain, a)
    loss_b, grads_b = _loss_and_grads(plug, b)
    assert torch.equal(loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), name
    assert plug._metrics["train"]["d3s/kept_sample_share"] == [1.0]


def _logits(model, ids, attn):
    with torch.no_grad():
        hidden = model.model(input_ids=ids, attention_mask=attn).last_hidden_state
        return model.lm_head(hidden).float()


@pytest.mark.parametrize("floor", [0, None])  # None: the preset's own floor (256 tokens)
def test_d3s_keeps_the_cores_rows_and_tokens_and_trains_on_them_only(folder, tmp_path, floor):
    plain = _trainer(GRPOTrainer, folder, tmp_path / "plain")
    cfg = D3SConfig.from_preset("d3s", **({} if floor is None else {"min_kept_tokens": floor}))
    plug = _trainer(PlugRec, folder, tmp_path / "plug", d3s=cfg)
    plug.state.max_steps, plug.state.global_step = 5, 2  # progress 1/2: N = 5/16 G, K = 12.5%
    full = _generate(plain)
    cut = _generate(plug)
    sel = plug.last_selection

    # the advantages D3S selects on are TRL's
    torch.testing.assert_close(sel["advantages"], full["advantages"].cpu(), rtol=0, atol=0)
    n = full["advantages"].numel()
    groups = trl_group_ids(n, G)
    n_keep = plug.d3s_selector.n_keep_at(0.5)
    ref = select_samples("d3s_cross", sel["rewards"], sel["advantages"], groups, n_keep)
    assert torch.equal(sel["sample_keep_global"], ref.sample_keep)
    rows = ref.sample_keep.nonzero().flatten()
    assert 0 < rows.numel() < n

    # TRL's entropies (its fused LM head, the kept rows only) are the model's
    ids = torch.cat([full["prompt_ids"], full["completion_ids"]], 1)[rows]
    attn = torch.cat([full["prompt_mask"], full["completion_mask"]], 1)[rows]
    width = full["completion_ids"].shape[1]
    logits = _logits(plug.model, ids, attn)[:, -width - 1 : -1]
    logp_all = torch.log_softmax(logits, -1)
    entropy_ref = -(logp_all.exp() * logp_all).sum(-1)
    response = full["completion_mask"].bool()[rows]
    torch.testing.assert_close(
        sel["entropy"] * response, entropy_ref * response, rtol=1e-4, atol=1e-4
    )

    # the tokens: the core's top-K of |A| x H over the kept rows, with the floor
    k = k_frac_with_floor(0.125, int(response.sum()), cfg.min_kept_tokens)
    scores = token_scores(sel["advantages"][rows], sel["entropy"], response)
    token_keep = top_k_batch(scores, response, k)
    assert torch.equal(sel["tokens"].token_keep, token_keep)
    if floor == 0:
        assert 0 < token_keep.sum() < response.sum()

    # the update's batch is the kept rows, with the kept tokens as its loss mask
    assert cut["completion_ids"].shape[0] == rows.numel()
    w = cut["completion_ids"].shape[1]
    assert torch.equal(cut["completion_ids"], full["completion_ids"][rows][:, :w])
    assert torch.equal(cut["tool_mask"].bool(), token_keep[:, :w])
    assert int(cut["num_items_in_batch"]) == int(token_keep.sum())

    # the training forward sees the kept rows only, and the gradient is the one of
    # -(1/N) sum_{kept tokens} A log p (on-policy: ratio 1, no clipping, beta 0)
    seen = []
    hook = plug.model.register_forward_pre_hook(
        lambda m, a, kw: seen.append(tuple(kw["input_ids"].shape)), with_kwargs=True
    )
    try:
        _, grads = _loss_and_grads(plug, cut)
    finally:
        hook.remove()
    # compacted: the rows holding a kept token, up to the last kept column
    last = int(token_keep.any(0).nonzero().max()) + 1
    assert seen == [(int(token_keep.any(1).sum()), cut["prompt_ids"].shape[1] + last)]
    plug.model.zero_grad(set_to_none=True)
    ids_c = torch.cat([cut["prompt_ids"], cut["completion_ids"]], 1)
    attn_c = torch.cat([cut["prompt_mask"], cut["completion_mask"]], 1)
    hidden = plug.model.model(input_ids=ids_c, attention_mask=attn_c).last_hidden_state
    logp = torch.log_softmax(plug.model.lm_head(hidden)[:, -w - 1 : -1].float(), -1)
    logp = logp.gather(-1, cut["completion_ids"].unsqueeze(-1)).squeeze(-1)
    keep = cut["tool_mask"].bool() & cut["completion_mask"].bool()
    adv = cut["advantages"].unsqueeze(1)
    ref_loss = -(adv * logp * keep).sum() / keep.sum()
    ref_loss.backward()
    for name, p in plug.model.named_parameters():
        if name in grads:
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6)
    logged = plug._metrics["train"]
    assert logged["d3s/kept_sample_share"] == [rows.numel() / n]
    assert logged["d3s/update_tokens"] == [float(token_keep.sum())]


def test_an_untested_trl_is_refused(folder, tmp_path, monkeypatch):
    from nemo_d3s.errors import RunError

    monkeypatch.delenv("NEMO_D3S_ALLOW_UNTESTED", raising=False)
    monkeypatch.setattr(trl, "__version__", "1.17.0")
    with pytest.raises(RunError, match="trl 1.17.0 is installed, .*NEMO_D3S_ALLOW_UNTESTED=1"):
        _trainer(D3SGRPOTrainer, folder, tmp_path)


def test_settings_the_plugin_cannot_honour_are_one_line_errors(folder, tmp_path):
    from nemo_d3s.errors import ConfigError

    with pytest.raises(
        ConfigError, match="top_entropy_quantile=0.2: .*set top_entropy_quantile=1.0"
    ):
        _trainer(D3SGRPOTrainer, folder, tmp_path, config={"top_entropy_quantile": 0.2})
    # TRL's own entropy mask stays available where D3S does not score tokens
    _trainer(D3SGRPOTrainer, folder, tmp_path, config={"top_entropy_quantile": 0.2}, d3s="d1s")
    # pods' N = 1/4 of G = 4 keeps one rollout a prompt: its re-normalised advantage is 0
    with pytest.raises(ConfigError, match=r"^d3s\.schedule\.n_init=0\.25 keeps 1 of the 4 .*=4\)$"):
        _trainer(D3SGRPOTrainer, folder, tmp_path, d3s="pods")
    with pytest.raises(ConfigError, match="d3s='nope': unknown preset; known: d1s, d1s_cross"):
        _trainer(D3SGRPOTrainer, folder, tmp_path, d3s="nope")
    # PODS re-normalises the kept rewards with its own estimator: TRL's must be the same one
    none = {"scale_rewards": "none"}
    with pytest.raises(
        ConfigError, match="advantage='grpo', which is not TRL's scale_rewards='none'.*dr_grpo"
    ):
        _trainer(D3SGRPOTrainer, folder, tmp_path, config=none, d3s="pods")
    _trainer(D3SGRPOTrainer, folder, tmp_path, config=none, d3s={"sample_rule": "pods", **DR})
    with pytest.raises(ConfigError, match="scale_rewards='batch'.*use scale_rewards='group'"):
        _trainer(D3SGRPOTrainer, folder, tmp_path, config={"scale_rewards": "batch"}, d3s="pods")
    with pytest.raises(ConfigError, match="multi_objective_aggregation='normalize_then_sum'"):
        _trainer(
            D3SGRPOTrainer,
            folder,
            tmp_path,
            config={"multi_objective_aggregation": "normalize_then_sum"},
            d3s="pods",
        )
    # the other rules keep TRL's advantages, whatever their scaling
    _trainer(D3SGRPOTrainer, folder, tmp_path, config={"scale_rewards": "batch"}, d3s="d3s")


DR = {"advantage": "dr_grpo"}


def _run_ranks(folder, out, nproc, preset, step):
    out.mkdir()
    script = Path(__file__).with_name("_trl_ranks.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}"]
    cmd += ["--standalone", str(script), folder, str(out), preset, str(step)]  # a free port
    env = dict(os.environ, OMP_NUM_THREADS="1")
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=WAIT_S, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    return [json.loads((out / f"rank{r}_of{nproc}.json").read_text()) for r in range(nproc)]


@pytest.mark.distributed
@pytest.mark.parametrize("preset,step", [("d3s", 2), ("d3s", 0)])  # d3s_i: test_trl_selection
def test_two_processes_keep_what_one_keeps(folder, tmp_path, preset, step):
    (one,) = _run_ranks(folder, tmp_path / "one", 1, preset, step)
    two = _run_ranks(folder, tmp_path / "two", 2, preset, step)
    assert two[0]["sample_keep_global"] == two[1]["sample_keep_global"]
    assert two[0]["sample_keep_global"] == one["sample_keep_global"]
    assert two[0]["rows"] + two[1]["rows"] == one["rows"]
    assert two[0]["token_keep"] + two[1]["token_keep"] == one["token_keep"]
    assert two[0]["num_items_in_batch"] == two[1]["num_items_in_batch"]
    assert two[0]["num_items_in_batch"] == one["num_items_in_batch"] > 0
    assert two[0]["cut_loss_tokens"] + two[1]["cut_loss_tokens"] == one["cut_loss_tokens"]
    assert 0 < len(one["rows"]) < 8
    # every process's cut batch and compacted loss batch hold as many rows (TRL gathers per-row
    # metrics in its loss: unequal rows aborted gloo, l.3280-3282), and the dapo loss is the
    # same: each process's share is over num_items_in_batch / processes, so their mean is one's
    assert two[0]["cut_rows"] == two[1]["cut_rows"]
    assert two[0]["loss_rows"] == two[1]["loss_rows"]
    assert (two[0]["loss"] + two[1]["loss"]) / 2 == pytest.approx(one["loss"], rel=1e-5)
    if step == 0:  # N = G/8: both kept rollouts are rank 1's; rank 0 runs zero-loss rows only
        assert two[0]["rows"] == [] and len(two[1]["rows"]) == 2
        assert two[0]["cut_rows"] == 2 and two[0]["cut_loss_tokens"] == 0
