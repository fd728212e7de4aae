"""backends/hf/routing.RouterHooks on tiny random transformers MoE models (Qwen3-MoE with and
without top-k renormalisation, Mixtral, Qwen2-MoE): the recorded experts are the top-k of
transformers' own router logits (``output_router_logits``); replaying them gives the forward's
logits bit for bit; replaying another routing gives the logits of a slow reference that routes
token by token, and the router still gets a gradient; positions left NO_EXPERT keep the
router's own choice; a dense model has no routers."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "megatron"))
from _tiny_hf import make_tiny_hf  # noqa: E402

from nemo_d3s.backends.hf.routing import RouterHooks, moe_routers  # noqa: E402
from nemo_d3s.core.routing import NO_EXPERT  # noqa: E402

ARCHS = ["qwen3_moe", "qwen3_moe_norm", "mixtral", "qwen2_moe"]


def _model(tmp_path, arch):
    from transformers import AutoModelForCausalLM

    folder = make_tiny_hf(tmp_path / arch, arch)
    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


def _ids(b=2, s=7, seed=0):
    return torch.randint(0, 256, (b, s), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", ARCHS)
def test_recorded_routing_is_the_routers_top_k_and_replays_bit_for_bit(tmp_path, arch):
    model = _model(tmp_path, arch)
    hooks = RouterHooks(model)
    L, K = model.config.num_hidden_layers, model.config.num_experts_per_tok
    assert hooks.is_moe and len(hooks.routers) == L
    ids = _ids()
    with torch.no_grad(), hooks.record(*ids.shape):
        out = model(input_ids=ids, output_router_logits=True)
    (routing,) = hooks.recorded
    assert routing.shape == (2, 7, L, K)
    for layer, logits in enumerate(out.router_logits):  # transformers' own, [b s, E]
        want = torch.softmax(logits.float(), dim=-1).topk(K, dim=-1).indices.view(2, 7, K)
        assert torch.equal(routing[:, :, layer], want)
    with torch.no_grad(), hooks.replay(routing):
        again = model(input_ids=ids).logits
    assert torch.equal(again, out.logits)
    assert torch.equal(hooks.recorded[-1], routing)
    unset = torch.full_like(routing, NO_EXPERT)  # nothing to replay: the router's own choice
    with torch.no_grad(), hooks.replay(unset):
        assert torch.equal(model(input_ids=ids).logits, out.logits)


def _reference_forward(model, ids, target):
    """The forward with every router replaced by a token-by-token loop that routes token n of
    layer l to target[n, l] with the softmax probabilities of those experts (renormalised over
    the K where the router renormalises)."""
    saved = []
    for layer, router in enumerate(moe_routers(model)):

        def forward(hidden, router=router, layer=layer):
            hidden = hidden.reshape(-1, router.weight.shape[1])
            logits = torch.nn.functional.linear(hidden, router.weight)
            probs = torch.softmax(logits.float(), dim=-1)
            chosen = target[:, :, layer].reshape(-1, target.shape[-1])
            renorm = type(router).__name__ == "MixtralTopKRouter" or router.norm_topk_prob
            rows = []
            for n in range(chosen.shape[0]):
                p = [probs[n, int(e)] for e in chosen[n]]
                total = sum(p) if renorm else 1.0
                rows.append(torch.stack([x / total for x in p]))
            scores = torch.stack(rows)
            if type(router).__name__ != "MixtralTopKRouter":
                scores = scores.to(logits.dtype)
            return logits, scores, chosen.long()

        saved.append((router, router.forward))
        router.forward = forward
    try:
        return model(input_ids=ids).logits
    finally:
        for router, fwd in saved:
            router.forward = fwd


@pytest.mark.parametrize("arch", ARCHS)
def test_replaying_another_routing_matches_a_token_by_token_reference(tmp_path, arch):
    model = _model(tmp_path, arch)
    hooks = RouterHooks(model)
    ids = _ids(seed=1)
    with torch.no_grad(), hooks.record(*ids.shape):
        plain = model(input_ids=ids).logits
    E = len(moe_routers(model)[0].weight)
    other = (hooks.recorded[0] + 1) % E  # every token sent elsewhere, the K still distinct
    model.zero_grad()
    with hooks.replay(other):
        replayed = model(input_ids=ids).logits
    with torch.no_grad():
        want = _reference_forward(model, ids, other)
    assert not torch.allclose(replayed, plain, atol=1e-3)
    torch.testing.assert_close(replayed, want, rtol=1e-5, atol=1e-5)
    replayed.logsumexp(-1).sum().backward()  # the router learns through the replayed scores
    assert all(float(r.weight.grad.abs().sum()) > 0 for r in moe_routers(model))


def test_a_routing_of_the_wrong_shape_is_refused_and_a_dense_model_has_no_routers(tmp_path):
    from transformers import AutoModelForCausalLM

    model = _model(tmp_path, "qwen3_moe")
    hooks = RouterHooks(model)
    ids = _ids()
    with pytest.raises(ValueError, match="is not \\[b, s, 4, K\\]"):
        hooks.replay(torch.zeros(2, 7, 3, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="layer 0 routes"):
        with torch.no_grad(), hooks.replay(torch.zeros(2, 6, 4, 2, dtype=torch.long)):
            model(input_ids=ids)
    dense = AutoModelForCausalLM.from_pretrained(str(make_tiny_hf(tmp_path / "llama", "llama")))
    assert not RouterHooks(dense).is_moe


def _checkpointing(model):
    """Gradient checkpointing as the HF backend turns it on (transformers 5 renamed the method)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return model


def _grads(model, hooks, ids, target):
    model.zero_grad()
    with hooks.replay(target):
        logits = model(input_ids=ids).logits
    logits.logsumexp(-1).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_under_gradient_checkpointing_the_recomputed_forward_replays_the_routing(tmp_path, arch):
    """The backward recomputes each layer's forward after the replay's context closed: kept per
    layer (``recompute=True``) the gradients equal those without checkpointing; without them
    the recomputed forward routes by itself (the failure this fixes)."""
    import copy

    from torch.utils.checkpoint import CheckpointError

    plain = _model(tmp_path, arch).train()
    ids = _ids(seed=2)
    hooks = RouterHooks(plain)
    with torch.no_grad(), hooks.record(*ids.shape):
        plain(input_ids=ids)
    E = len(moe_routers(plain)[0].weight)
    other = (hooks.recorded[0] + 1) % E
    want = _grads(plain, RouterHooks(plain), ids, other)

    def checkpointed(recompute):
        model = _model(tmp_path, arch).train()
        _checkpointing(model)
        return model, RouterHooks(model, recompute=recompute)

    model, kept = checkpointed(True)
    got = _grads(model, kept, ids, other)
    assert got.keys() == want.keys()
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-6, msg=n)
    assert not any(kept._kept)
    # a copy of the model (the frozen reference is one) carries the hooks but routes by itself
    ref = copy.deepcopy(model)
    with torch.no_grad():
        torch.testing.assert_close(ref(input_ids=ids).logits, plain(input_ids=ids).logits)
    # without them: torch's checkpoint sees the recomputed forward save fewer tensors (no
    # replayed scores) and refuses the backward
    model, lost = checkpointed(False)
    with pytest.raises(CheckpointError, match="different number of tensors was saved"):
        _grads(model, lost, ids, other)


def test_a_kept_routing_left_unused_is_an_error(tmp_path):
    model = _checkpointing(_model(tmp_path, "qwen3_moe").train())
    hooks = RouterHooks(model, recompute=True)
    ids = _ids()
    target = torch.zeros(2, 7, 4, 2, dtype=torch.long)
    target[..., 1] = 1
    with hooks.replay(target):
        model(input_ids=ids)  # no backward: the kept routings are never recomputed
    with pytest.raises(RuntimeError, match="4 layer routings kept for a recomputed forward"):
        with hooks.replay(target):
            pass
