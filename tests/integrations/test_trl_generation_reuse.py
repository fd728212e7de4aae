"""The TRL plugin where TRL reuses a generation batch, through TRL's own ``Trainer.train()``
(marker ``trl``; collected only where trl is installed, tests/conftest.py):

- ``steps_per_generation > 1``: TRL shuffles the generation batch and splits it into
  micro-batches (grpo_trainer.py l.1542-1546); the plugin pads each process to a multiple
  with zero-loss placeholder rows;
- ``num_iterations > 1``: TRL buffers the split batch and reuses it for several optimizer
  steps (l.1538-1546), with ``old_per_token_logps`` computed at generation time (l.2643).

With preset ``grpo`` every micro-step's loss, every optimizer step's gradients and the final
weights equal plain ``GRPOTrainer``'s. With ``d3s`` the rows of every micro-batch are the kept
rows (plus placeholders, which add exactly 0 to the dapo loss and its gradient), the reused
iterations see the same cut rows, ``old_per_token_logps`` are the generation-time policy's
log-probabilities of those rows (recomputed here), selection runs once per generation, and
the logged shares are that generation's. On 2 processes (torchrun, gloo) each rank pads to
its own multiple and both run the same number of passes. Loss types the padding would bias
are refused.

TRL's vLLM branch (``use_vllm``, l.1767) runs with a stand-in for vLLM's engine (its
``generate`` contract, trl/generation/vllm_generation.py l.550-657): the batch then carries
``sampling_per_token_logps``, ``old_per_token_logps`` and ``importance_sampling_ratio``,
which the cut must keep aligned with the kept rows.
"""

from __future__ import annotations

import collections
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
from transformers import TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from nemo_d3s.backends.hf.config import TinyModelSpec  # noqa: E402
from nemo_d3s.backends.hf.loading import ensure_tiny_folder  # noqa: E402
from nemo_d3s.core.presets import D3SConfig  # noqa: E402
from nemo_d3s.errors import ConfigError  # noqa: E402
from nemo_d3s.integrations.trl import D3SGRPOTrainer  # noqa: E402
from _limits import WAIT_S  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _trl_record import SelectionRecorder  # noqa: E402

pytestmark = pytest.mark.trl

G = 4
B = 6  # per_device_train_batch_size: with steps_per_generation 2, 12 rollouts = 3 prompts


def _reward(completions, **kw):
    return [float(sum(map(ord, c)) % 5) for c in completions]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(ensure_tiny_folder(TinyModelSpec(), 0, cache=tmp_path_factory.mktemp("cache")))


def _clone(batch):
    return {k: v.clone() if torch.is_tensor(v) else copy.deepcopy(v) for k, v in batch.items()}


class _Recorder:
    """Records what TRL's step hands the loss (every micro-batch) and, for the plugin, every
    generation batch before and after the cut, with the generation-time policy's
    log-probabilities of the whole batch computed here (not by TRL)."""

    def _compute_loss(self, model, inputs):
        loss = super()._compute_loss(model, inputs)
        self.micro.append((_clone(inputs), loss.detach().clone()))
        return loss

    def _d3s_cut(self, output):
        full = _clone(output)
        full["own_logps"] = _logps(self.model, full)
        cut = super()._d3s_cut(output)
        self.gens.append((full, dict(self.last_selection), _clone(cut)))
        return cut


class PlainRec(_Recorder, GRPOTrainer):
    pass


class PlugRec(_Recorder, SelectionRecorder, D3SGRPOTrainer):
    pass


class _Grads(TrainerCallback):
    """The gradients each optimizer step applies (after TRL's accumulation)."""

    def __init__(self):
        self.trainer, self.steps = None, []

    def on_pre_optimizer_step(self, args, state, control, **kw):
        named = self.trainer.model.named_parameters()
        self.steps.append({n: p.grad.clone() for n, p in named if p.grad is not None})


@torch.no_grad()
def _logps(model, batch):
    """[B, C] log p(completion token) under ``model``, written out (no TRL helper)."""
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attn = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    c = batch["completion_ids"].shape[1]
    hidden = model.model(input_ids=ids, attention_mask=attn).last_hidden_state
    logp = torch.log_softmax(model.lm_head(hidden)[:, -c - 1 : -1].float(), -1)
    return logp.gather(-1, batch["completion_ids"].unsqueeze(-1)).squeeze(-1)


def _trainer(cls, folder, out, spg, gas, iters, max_steps, config=None, batch=B, **kw):
    args = GRPOConfig(
        **(config or {}),
        output_dir=str(out),
        use_cpu=True,
        per_device_train_batch_size=batch,
        num_generations=G,
        steps_per_generation=spg,
        gradient_accumulation_steps=gas,
        num_iterations=iters,
        max_steps=max_steps,
        max_completion_length=8,
        max_grad_norm=0.0,  # the raw accumulated gradient reaches the optimizer
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        seed=0,
        bf16=False,
    )
    grads = _Grads()
    trainer = cls(
        model=folder,
        reward_funcs=_reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": [f"count to {i}" for i in range(6)]}),
        callbacks=[grads],
        **kw,
    )
    grads.trainer = trainer
    trainer.grads, trainer.micro, trainer.gens = grads, [], []
    return trainer


# (steps_per_generation, gradient_accumulation_steps, num_iterations): aligned (TRL keeps no
# old log-probs), split over two optimizer steps, and reused for two iterations.
SETTINGS = [(2, 2, 1), (2, 1, 1), (2, 2, 2)]


def _micro_steps(spg, gas, iters, generations=2):
    """(max_steps, micro-steps per generation) for ``generations`` generations."""
    per_gen = spg * iters
    return generations * per_gen // gas, per_gen


@pytest.mark.parametrize("spg,gas,iters", SETTINGS)
def test_grpo_preset_trains_like_plain_trl(folder, tmp_path, spg, gas, iters):
    max_steps, _ = _micro_steps(spg, gas, iters)
    # each built just before it trains: the constructor seeds torch's RNG, train() does not
    plain = _trainer(PlainRec, folder, tmp_path / "plain", spg, gas, iters, max_steps)
    plain.train()
    plug = _trainer(PlugRec, folder, tmp_path / "plug", spg, gas, iters, max_steps, d3s="grpo")
    plug.train()
    assert len(plain.micro) == len(plug.micro) == max_steps * gas
    for (a, loss_a), (b, loss_b) in zip(plain.micro, plug.micro):
        assert sorted(a) == sorted(b)
        for key in a:
            assert a[key] is None and b[key] is None or torch.equal(a[key], b[key]), key
        assert torch.equal(loss_a, loss_b)
    assert len(plain.grads.steps) == len(plug.grads.steps) == max_steps
    for ga, gb in zip(plain.grads.steps, plug.grads.steps):
        assert ga.keys() == gb.keys() and ga
        for name in ga:
            assert torch.equal(ga[name], gb[name]), name
    for (name, pa), pb in zip(plain.model.named_parameters(), plug.model.parameters()):
        assert torch.equal(pa, pb), name
    shares = [r["d3s/kept_sample_share"] for r in plug.state.log_history if "d3s/n_keep" in r]
    assert shares == [1.0, 1.0]


def _row_of(full, row):
    """The index of the generation batch's row that a micro-batch row is (its prompt and
    completion tokens; the completion may be trimmed to the kept width)."""
    w = row["completion_ids"].shape[0]
    same = (full["prompt_ids"] == row["prompt_ids"]).all(1)
    same &= (full["completion_ids"][:, :w] == row["completion_ids"]).all(1)
    same &= full["completion_mask"][:, w:].sum(1) == 0
    (hits,) = same.nonzero(as_tuple=True)
    assert hits.numel() == 1, "ambiguous rows: pick other seeds"
    return int(hits[0])


def _rows(batch):
    n = batch["completion_ids"].shape[0]
    return [
        {k: v[i] for k, v in batch.items() if torch.is_tensor(v) and v.dim() > 0} for i in range(n)
    ]


@pytest.mark.parametrize("spg,gas,iters", SETTINGS)
def test_d3s_steps_use_the_kept_rows_selected_once_per_generation(
    folder, tmp_path, spg, gas, iters
):
    max_steps, per_gen = _micro_steps(spg, gas, iters)
    cfg = D3SConfig.from_preset("d3s", min_kept_tokens=0)
    plug = _trainer(PlugRec, folder, tmp_path, spg, gas, iters, max_steps, d3s=cfg)
    calls = []
    select_whole = plug.d3s_selector.select_whole
    plug.d3s_selector.select_whole = lambda *a, **k: calls.append(a[-1]) or select_whole(*a, **k)
    plug.train()

    # one selection per generation, at the progress of the optimizer step that generated
    assert len(plug.gens) == 2 and len(plug.micro) == 2 * per_gen
    steps_per_gen = per_gen // gas
    assert calls == [0.0, steps_per_gen / (max_steps - 1)]
    old_kept = gas % per_gen != 0  # TRL l.2643
    n_pads, placeholders = [], []
    for g, (full, sel, cut) in enumerate(plug.gens):
        kept = sel["stage"].kept_rows.tolist()
        token_keep = sel["tokens"].token_keep
        assert ("old_per_token_logps" in full) == old_kept
        micro = plug.micro[g * per_gen : (g + 1) * per_gen]
        # the further iterations reuse the buffered CUT micro-batches, unchanged
        for i in range(spg, per_gen):
            first, again = micro[i % spg][0], micro[i][0]
            assert sorted(first) == sorted(again)
            for key, value in first.items():
                assert value is None or torch.equal(value, again[key]), key
        seen = collections.Counter()
        n_pad = cut["completion_ids"].shape[0] - len(kept)
        for batch, _ in micro[:spg]:
            assert batch["completion_ids"].shape[0] == cut["completion_ids"].shape[0] // spg
            assert int(batch["num_items_in_batch"]) == int(token_keep.sum())
            for i, row in enumerate(_rows(batch)):
                j = _row_of(full, row)
                w = row["completion_ids"].shape[0]
                torch.testing.assert_close(row["advantages"], full["advantages"][j], rtol=0, atol=0)
                if old_kept:  # the generation-time policy's log-probs of THIS row
                    assert torch.equal(
                        row["old_per_token_logps"], full["old_per_token_logps"][j, :w]
                    )
                    mask = row["completion_mask"].bool()
                    torch.testing.assert_close(
                        row["old_per_token_logps"][mask],
                        full["own_logps"][j, :w][mask],
                        rtol=1e-4,
                        atol=1e-4,
                    )
                else:
                    assert "old_per_token_logps" not in row
                seen[j] += 1
                tokens = token_keep[kept.index(j), :w] if j in kept else None
                if tokens is None or not torch.equal(row["tool_mask"].bool(), tokens):
                    # a placeholder: a copy of row 0 with an all-zero loss mask
                    assert j == 0 and row["tool_mask"].sum() == 0
                    placeholders.append((batch, i))
        assert seen == collections.Counter(kept) + collections.Counter({0: n_pad})
        assert (len(kept) + n_pad) % spg == 0 and n_pad < spg
        n_pads.append(n_pad)

        # the shares logged at the generating step are this generation's
        step = g * steps_per_gen + 1
        (logged,) = [r for r in plug.state.log_history if r.get("step") == step and "loss" in r]
        response = sel["response_mask"]
        assert logged["d3s/kept_sample_share"] == len(kept) / response.shape[0]
        assert logged["d3s/update_tokens"] == float(token_keep.sum())
        assert logged["d3s/kept_token_share"] == float(token_keep.sum()) / float(response.sum())
        assert logged["d3s/placeholder_rows"] == n_pad
    # the reused steps log no selection of their own
    logged_steps = [r["step"] for r in plug.state.log_history if "d3s/n_keep" in r]
    assert logged_steps == [1, steps_per_gen + 1]
    assert sum(n_pads) > 0, "no placeholder was exercised"

    # a placeholder adds exactly 0 to the dapo loss and to its gradient
    batch, i = placeholders[0]
    only = {k: v[i : i + 1] if torch.is_tensor(v) and v.dim() else v for k, v in batch.items()}
    plug.model.zero_grad(set_to_none=True)
    loss = plug._compute_loss(plug.model, only)
    loss.backward()
    assert loss.item() == 0.0
    grads = [p.grad for p in plug.model.parameters() if p.grad is not None]
    assert grads and all(torch.count_nonzero(gr) == 0 for gr in grads)


@pytest.mark.distributed
def test_two_processes_pad_each_to_its_own_micro_batches(folder, tmp_path):
    script = Path(__file__).with_name("_trl_reuse_ranks.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    res = subprocess.run(
        cmd + [str(script), folder, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=WAIT_S,
        env=env,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}_of2.json").read_text()) for r in range(2)]
    assert ranks[0]["param_sum"] == ranks[1]["param_sum"]  # DDP kept them in step
    for g in range(2):  # two generations, each used by 2 iterations x 2 micro-batches
        gens = [rank["gens"][g] for rank in ranks]
        assert gens[0]["keep_global"] == gens[1]["keep_global"]
        assert gens[0]["kept_local"] + gens[1]["kept_local"] == sum(gens[0]["keep_global"])
        kept_tokens = gens[0]["kept_tokens_local"] + gens[1]["kept_tokens_local"]
        for rank, gen in zip(ranks, gens):
            micro = rank["micro"][4 * g : 4 * g + 4]
            assert micro[2:] == micro[:2]  # the second iteration reuses the cut batch
            pad = gen["cut_rows"] - gen["kept_local"]
            assert gen["cut_rows"] % 2 == 0 and 0 <= pad < 2 or gen["kept_local"] == 0
            assert [m["rows"] for m in micro[:2]] == [gen["cut_rows"] // 2] * 2
            assert sum(m["zero_rows"] for m in micro[:2]) >= pad
            assert sum(m["loss_tokens"] for m in micro[:2]) == gen["kept_tokens_local"]
            assert all(m["num_items_in_batch"] == kept_tokens for m in micro)
    assert any(r["gens"][g]["cut_rows"] > r["gens"][g]["kept_local"] for r in ranks for g in (0, 1))


# TRL 1.16's loss types by normaliser (grpo_trainer.py l.3153-3180): each micro-batch's own
# rows or tokens, or the recounted num_items_in_batch
MEAN_OVER_MICRO_BATCH = ("grpo", "sapo", "bnpo", "dr_grpo", "luspo")
OVER_NUM_ITEMS = ("dapo", "cispo", "vespo")


def _build(folder, tmp_path, d3s="d3s", spg=2, **config):
    return _trainer(D3SGRPOTrainer, folder, tmp_path, spg, spg, 1, 2, config, 8, d3s=d3s)


def test_losses_that_padding_would_bias_are_refused(folder, tmp_path):
    for loss in MEAN_OVER_MICRO_BATCH:
        with pytest.raises(
            ConfigError,
            match=f"loss_type='{loss}' with steps_per_generation=2, 1 process.*loss_type='dapo'",
        ):
            _build(folder, tmp_path, loss_type=loss)
    with pytest.raises(ConfigError, match="entropy_coef=0.1 with steps_per_generation=2.*"):
        _build(folder, tmp_path, entropy_coef=0.1)
    for loss in OVER_NUM_ITEMS:
        _build(folder, tmp_path, loss_type=loss)  # divided by the recounted num_items_in_batch
    _build(folder, tmp_path, d3s="grpo", loss_type="grpo")  # nothing cut, nothing padded
    _build(folder, tmp_path, spg=1, loss_type="grpo")  # one micro-batch on one process


def test_several_processes_with_one_micro_batch_each_refuse_those_losses(
    folder, tmp_path, monkeypatch
):
    """steps_per_generation=1 on 2 processes: each process holds its own number of kept rows
    (padded), so a per-micro-batch mean weighs the processes' rollouts unequally. The
    process count is accelerate's (patched to 2 here: the trainer asks nothing else)."""
    from accelerate import Accelerator

    monkeypatch.setattr(Accelerator, "num_processes", property(lambda self: 2))
    for loss in MEAN_OVER_MICRO_BATCH:
        with pytest.raises(
            ConfigError, match=f"loss_type='{loss}' with steps_per_generation=1, 2 process"
        ):
            _build(folder, tmp_path, spg=1, loss_type=loss)
    with pytest.raises(ConfigError, match="entropy_coef=0.1 with steps_per_generation=1, 2 proc"):
        _build(folder, tmp_path, spg=1, entropy_coef=0.1)
    _build(folder, tmp_path, spg=1, loss_type="dapo")
    _build(folder, tmp_path, spg=1, d3s="grpo", loss_type="grpo")  # nothing cut, nothing padded


class _GradsAndWeights(_Grads):
    """Also the weights each optimizer step's gradients were taken at."""

    def __init__(self):
        super().__init__()
        self.weights = []

    def on_pre_optimizer_step(self, args, state, control, **kw):
        super().on_pre_optimizer_step(args, state, control, **kw)
        self.weights.append(copy.deepcopy(self.trainer.model.state_dict()))


@pytest.mark.parametrize("loss", ["cispo", "vespo"])
def test_padded_micro_batches_give_the_gradient_of_the_kept_rows_alone(folder, tmp_path, loss):
    """cispo and vespo are allowed with steps_per_generation > 1 because they divide by
    ``num_items_in_batch`` (the recounted kept tokens, TRL l.3168) and weigh each token or
    row on its own (cispo l.3109, vespo's per-row phi l.2972): the optimizer step's gradient,
    accumulated over the padded micro-batches, is the gradient of ONE pass of TRL's loss over
    the kept rows without placeholders, at the same weights."""
    # 1 rollout per prompt: 3 of the 12 (odd: a placeholder), half of their tokens
    fixed = {"n_init": 1, "n_final": 1, "k_init": 0.5, "k_final": 0.5}
    cfg = D3SConfig.from_preset("d3s", min_kept_tokens=0, schedule=fixed)
    plug = _trainer(PlugRec, folder, tmp_path, 2, 2, 1, 2, {"loss_type": loss}, d3s=cfg)
    rec = _GradsAndWeights()
    rec.trainer = plug.grads.trainer
    plug.callback_handler.remove_callback(plug.grads)
    plug.add_callback(rec)
    plug.train()
    assert len(plug.gens) == len(rec.steps) == 2  # one optimizer step per generation
    n_pads = []
    for (_, sel, cut), grads, weights in zip(plug.gens, rec.steps, rec.weights):
        n_kept = int(sel["stage"].kept_rows.numel())
        n_pads.append(cut["completion_ids"].shape[0] - n_kept)
        alone = {k: v[:n_kept] if torch.is_tensor(v) and v.dim() else v for k, v in cut.items()}
        assert int(alone["num_items_in_batch"]) == int(sel["tokens"].token_keep.sum())
        model = copy.deepcopy(plug.model)
        model.load_state_dict(weights)
        model.train()
        plug.model.train()  # TRL's "train" normaliser: x gradient_accumulation / spg = 1 here
        model.zero_grad(set_to_none=True)
        plug._compute_loss(model, alone).backward()
        got = dict(model.named_parameters())
        assert grads.keys() == {n for n, p in got.items() if p.grad is not None} and grads
        for name, grad in grads.items():
            torch.testing.assert_close(grad, got[name].grad, rtol=1e-4, atol=1e-7)
    assert sum(n_pads) > 0, "no placeholder was exercised"


class _VLLMStandIn:
    """vLLM's engine as TRL 1.16 calls it (``VLLMGeneration.generate``, server mode on one
    process: one request with n = G per unique prompt, vllm_generation.py l.593-657):
    returns (prompt ids, completion ids, top-1 logprobs per token, None). The completions
    and their "sampling" log-probs are drawn from a fixed generator, some ending in EOS."""

    def __init__(self, eos: int, vocab: int):
        self.eos, self.vocab, self.syncs = eos, vocab, 0

    def sync_weights(self):
        self.syncs += 1

    def generate(self, prompts, images, num_generations, profiler):
        g = torch.Generator().manual_seed(11)
        prompt_ids, completions, logprobs = [], [], []
        for ids in prompts[::num_generations]:
            for _ in range(num_generations):
                n = int(torch.randint(2, 9, (1,), generator=g))
                toks = torch.randint(0, self.vocab, (n,), generator=g).tolist()
                if n < 8:
                    toks[-1] = self.eos
                prompt_ids.append(list(ids))
                completions.append(toks)
                lp = (-torch.rand(n, generator=g) * 6 - 0.5).tolist()
                logprobs.append([[x] for x in lp])
        return prompt_ids, completions, logprobs, None


def _vllm_trainer(cls, folder, out, **kw):
    trainer = _trainer(
        cls,
        folder,
        out,
        1,
        1,
        1,
        1,
        {"vllm_importance_sampling_mode": "token_truncate"},
        8,
        **kw,
    )
    # TRL's use_vllm path with the engine replaced (building VLLMGeneration needs vLLM)
    trainer.use_vllm = True
    vocab = trainer.model.config.vocab_size
    trainer.vllm_generation = _VLLMStandIn(trainer._tokenizer.eos_token_id, vocab)
    trainer._last_loaded_step = -1
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    return trainer


def _vllm_batch(trainer):
    inputs = [{"prompt": f"count to {i}"} for i in range(2) for _ in range(G)]
    return trainer._generate_and_score_completions(inputs)


def _loss_and_grads(trainer, batch):
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in trainer.model.named_parameters()}


def test_vllm_batches_grpo_is_plain_trl_and_d3s_cuts_the_sampling_keys(folder, tmp_path):
    plain = _vllm_trainer(GRPOTrainer, folder, tmp_path / "plain")
    same = _vllm_trainer(D3SGRPOTrainer, folder, tmp_path / "same", d3s="grpo")
    a, b = _vllm_batch(plain), _vllm_batch(same)
    assert {"sampling_per_token_logps", "old_per_token_logps", "importance_sampling_ratio"} <= set(
        a
    )
    assert plain.vllm_generation.syncs == 1  # TRL's own vLLM branch ran
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    loss_a, grads_a = _loss_and_grads(plain, a)
    loss_b, grads_b = _loss_and_grads(same, b)
    assert torch.equal(loss_a, loss_b)
    assert all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a)

    cfg = D3SConfig.from_preset("d3s", min_kept_tokens=0)
    plug = _vllm_trainer(PlugRec, folder, tmp_path / "plug", d3s=cfg)
    cut = _vllm_batch(plug)
    full, sel, _ = plug.gens[0]
    assert torch.equal(full["importance_sampling_ratio"], a["importance_sampling_ratio"])
    rows = sel["stage"].kept_rows
    assert 0 < rows.numel() < 2 * G
    w = cut["completion_ids"].shape[1]
    for key in ("sampling_per_token_logps", "old_per_token_logps", "importance_sampling_ratio"):
        assert torch.equal(cut[key], full[key][rows][:, :w]), key
    # on-policy (old = the policy's own log-probs): the gradient of
    # -(1/N) sum_{kept tokens} IS_t A exp(logp - sg[logp]), written out
    _, grads = _loss_and_grads(plug, cut)
    plug.model.zero_grad(set_to_none=True)
    ids = torch.cat([cut["prompt_ids"], cut["completion_ids"]], 1)
    attn = torch.cat([cut["prompt_mask"], cut["completion_mask"]], 1)
    hidden = plug.model.model(input_ids=ids, attention_mask=attn).last_hidden_state
    logp = torch.log_softmax(plug.model.lm_head(hidden)[:, -w - 1 : -1].float(), -1)
    logp = logp.gather(-1, cut["completion_ids"].unsqueeze(-1)).squeeze(-1)
    keep = (cut["tool_mask"] * cut["completion_mask"]).bool()
    adv = cut["advantages"].unsqueeze(1)
    per_token = cut["importance_sampling_ratio"] * adv * torch.exp(logp - logp.detach())
    (-(per_token * keep).sum() / keep.sum()).backward()
    for name, p in plug.model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6)
