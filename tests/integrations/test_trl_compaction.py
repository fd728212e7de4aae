"""The TRL plugin's compaction against TRL's masked loss (marker ``trl``; collected only where
trl is installed, tests/conftest.py).

Each training micro-batch is cut after its last kept token before TRL's forward
(``compact_rows``). For every loss type the plugin allows (all eight with one micro-batch on
one process, those over ``num_items_in_batch`` with ``steps_per_generation=2``), each
micro-batch's loss and gradients equal those of TRL's loss on the same micro-batch
uncompacted, at old log-probabilities away from the policy's (ratios off 1, some clipped), and
the forward sees fewer tokens: fewer columns always, fewer rows where the loss does not count
them.
"""

from __future__ import annotations

import copy

import pytest
import torch

trl = pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402
from trl import GRPOConfig  # noqa: E402

from nemo_d3s.backends.hf.config import TinyModelSpec  # noqa: E402
from nemo_d3s.backends.hf.loading import ensure_tiny_folder  # noqa: E402
from nemo_d3s.core.presets import D3SConfig  # noqa: E402
from nemo_d3s.integrations.trl import D3SGRPOTrainer  # noqa: E402
from nemo_d3s.integrations.trl.selection import ROW_COUNTING_LOSSES  # noqa: E402

pytestmark = pytest.mark.trl

G = 4
B = 16  # rollouts per micro-batch
ALL_LOSSES = ("grpo", "sapo", "bnpo", "dr_grpo", "luspo", "dapo", "cispo", "vespo")
OVER_NUM_ITEMS = ("dapo", "cispo", "vespo")
CASES = [(1, loss) for loss in ALL_LOSSES] + [(2, loss) for loss in OVER_NUM_ITEMS]
# float32 throughout. Compaction changes the shapes of the forward's matmuls (fewer rows and
# columns), hence how float32 sums are blocked, not what is summed: values move by a few ulps
# (eps 1.2e-7) of their terms' magnitude, so differences are bounded against each tensor's
# scale, not elementwise (a gradient entry near 0 differs by the same absolute amount).
# Measured worst over these cases: loss 1.0e-6 relative, gradient max|diff| / max|grad|
# 2.9e-6 (vespo: its weight exponentiates a sum of log-ratios); the bound leaves 7x.
TOL = 2e-5


def _reward(completions, **kw):
    return [float(sum(map(ord, c)) % 5) for c in completions]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(ensure_tiny_folder(TinyModelSpec(), 0, cache=tmp_path_factory.mktemp("cache")))


def _trainer(folder, out, spg, loss):
    args = GRPOConfig(
        output_dir=str(out),
        use_cpu=True,
        per_device_train_batch_size=B,
        num_generations=G,
        steps_per_generation=spg,
        gradient_accumulation_steps=spg,
        max_completion_length=16,
        loss_type=loss,
        report_to="none",
        save_strategy="no",
        seed=0,
        bf16=False,
    )
    # 3 of 4 rollouts per prompt, a quarter of their tokens (no floor)
    fixed = {"n_init": 0.75, "n_final": 0.75, "k_init": 0.25, "k_final": 0.25}
    cfg = D3SConfig.from_preset("d3s", min_kept_tokens=0, schedule=fixed)
    prompts = [f"count to {i}" for i in range(B * spg // G)]
    trainer = D3SGRPOTrainer(
        model=folder,
        reward_funcs=_reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        d3s=cfg,
    )
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = spg
    return trainer, prompts


def _micro_batches(trainer, prompts, spg):
    """TRL's own split of one generation batch into ``spg`` micro-batches (l.1538-1546), with
    old log-probabilities moved off the policy's: [(micro-batch, old - own log-probs)]."""
    torch.manual_seed(0)
    inputs = [{"prompt": p} for p in prompts for _ in range(G)]  # RepeatSampler's order
    trainer._step, trainer._buffered_inputs = 0, None
    trainer._prepare_inputs(inputs)
    g = torch.Generator().manual_seed(1)
    out = []
    for batch in trainer._buffered_inputs:
        batch = dict(batch)
        with torch.no_grad():
            ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
            attn = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
            c = batch["completion_ids"].shape[1]
            own, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, attn, c)
        # the random model's completions all run to max_completion_length: end the kept
        # tokens 3 columns early, as shorter completions would
        batch["tool_mask"] = batch["tool_mask"].clone()
        batch["tool_mask"][:, -3:] = 0
        noise = 0.3 * torch.randn(own.shape, generator=g)
        batch["old_per_token_logps"] = own + noise
        out.append((batch, noise))
    return out


def _run(trainer, batch, compact):
    """(loss, gradients, forward input shapes) of one micro-batch."""
    trainer.d3s_compact = compact
    shapes = []
    hook = trainer.model.register_forward_pre_hook(
        lambda m, a, kw: shapes.append(tuple(kw["input_ids"].shape)), with_kwargs=True
    )
    trainer.model.zero_grad(set_to_none=True)
    try:
        loss = trainer.compute_loss(trainer.model, copy.copy(batch))
        loss.backward()
    finally:
        hook.remove()
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, shapes


@pytest.mark.parametrize("spg,loss", CASES)
def test_compacted_loss_and_gradients_equal_the_masked_ones(folder, tmp_path, spg, loss):
    trainer, prompts = _trainer(folder, tmp_path, spg, loss)
    batches = _micro_batches(trainer, prompts, spg)
    assert len(batches) == spg
    fewer_rows = fewer_cols = 0
    clipped = 0
    for batch, noise in batches:
        keep = (batch["completion_mask"] * batch["tool_mask"]).bool()
        assert 0 < keep.sum() < batch["completion_mask"].sum()  # the token level acts
        loss_m, grads_m, (shape_m,) = _run(trainer, batch, compact=False)
        loss_c, grads_c, (shape_c,) = _run(trainer, batch, compact=True)
        assert loss_c.item() != 0.0
        assert abs(loss_c.item() - loss_m.item()) <= TOL * abs(loss_m.item())
        assert grads_c.keys() == grads_m.keys() and grads_c
        for name, g in grads_m.items():
            assert (grads_c[name] - g).abs().max() <= TOL * g.abs().max(), name
        # what the forward saw: the rows with a kept token (all rows where the loss counts
        # them), the columns up to the last kept token
        rows = int(keep.any(1).sum()) if loss not in ROW_COUNTING_LOSSES else keep.shape[0]
        last = int(keep.any(0).nonzero().max()) + 1
        p = batch["prompt_ids"].shape[1]
        assert shape_m == (keep.shape[0], p + keep.shape[1])
        assert shape_c == (rows, p + last)
        fewer_rows += rows < keep.shape[0]
        fewer_cols += last < keep.shape[1]
        clipped += int((noise.abs() > 0.25)[keep].sum())  # ratio outside [0.78, 1.28]
    assert fewer_cols == spg
    if loss not in ROW_COUNTING_LOSSES:
        assert fewer_rows > 0, "no row was dropped: pick other seeds"
    assert clipped > 0  # TRL's clip (epsilon 0.2) binds on kept tokens
    shares = trainer._metrics["train"]["d3s/forward_token_share"]
    assert len(shares) == spg and all(0 < s < 1 for s in shares)
