"""``nemo_d3s.backends.megatron.cpu_compat``: megatron-core 0.16 / 0.19 on CPU / gloo ranks.

Every check runs inside gloo ranks (fresh processes from the fork server), so the patches
never reach the pytest process. Checked: ``apply_cpu_compat`` is idempotent and leaves
``torch`` itself alone; after it a tiny ``GPTModel`` (local layer spec, RoPE, tied
embeddings, dropout on) runs forward + backward through Megatron's own
``get_forward_backward_func`` at PP2 (1F1B: p2p buffers, the schedules' token counter, the
tied-embedding copy between stages) and TP2 (no pipelining); full activation recompute gives
the same gradients (the recomputed dropout masks are the first ones); ``seed_model_parallel``
gives Megatron's RNG tracker per-TP-rank CPU streams.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "distributed")
)
from _launch import run_ranks  # noqa: E402
from _limits import WAIT_S  # noqa: E402

SEQ, MICRO, N_MICRO = 6, 2, 2
PROXIED = (
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.utils",
)


def _torch_objects():
    return (
        torch.cuda.current_device,
        torch.cuda.synchronize,
        torch.Tensor.cuda,
        torch.zeros,
        torch.empty,
    )


def _patched_objects():
    """The proxied modules' ``torch`` and the patched megatron methods, as they are now."""
    import importlib

    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    torches = tuple(importlib.import_module(m).torch for m in PROXIED)
    return torches + (
        LanguageModule.setup_embeddings_and_output_layer,
        CudaRNGStatesTracker.add,
        CudaRNGStatesTracker.fork,
    )


# ---------------------------------------------------------------------------- rank bodies
def _rank_idempotent(rank):
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    from nemo_d3s.backends.megatron import cpu_compat

    before = _torch_objects()
    out = {"applied_before": cpu_compat.is_applied()}
    cpu_compat.apply_cpu_compat()
    first = _patched_objects()
    cpu_compat.apply_cpu_compat()
    second = _patched_objects()
    out["same_after_second_apply"] = all(a is b for a, b in zip(first, second))
    out["modules_proxied"] = all(t is not torch for t in second[: len(PROXIED)])
    # one wrapper around megatron's own method, not a wrapper of a wrapper
    wrapped = LanguageModule.setup_embeddings_and_output_layer.__wrapped__
    out["wrapped_once"] = not getattr(wrapped, "_nemo_d3s_cpu", False)
    out["torch_untouched"] = all(a is b for a, b in zip(before, _torch_objects()))
    out["applied_after"] = cpu_compat.is_applied()
    # megatron-core 0.19's start_grad_sync (param_and_grad_buffer.py:632) waits on
    # torch.cuda.current_stream() for CUDA-graph events: through the proxy, a stream whose
    # waits do nothing (CPU ops are synchronous); torch's own still needs CUDA
    import megatron.core.distributed.param_and_grad_buffer as pgb

    stream = pgb.torch.cuda.current_stream()
    out["proxy_stream_waits_nothing"] = (
        stream.wait_event(object()) is None and stream.wait_stream(stream) is None
    )
    out["torch_stream_still_cuda"] = torch.cuda.is_available() or _raises(torch.cuda.current_stream)
    # a fork of a state never added (no seed_model_parallel) runs on the current CPU stream
    torch.manual_seed(5)
    with get_cuda_rng_tracker().fork():
        inside = torch.rand(3)
    out["unseeded_fork"] = torch.equal(
        inside, torch.rand(3, generator=torch.Generator().manual_seed(5))
    )
    return out


def _raises(fn) -> bool:
    try:
        fn()
    except (RuntimeError, AssertionError):
        return True
    return False


def _tiny_gpt(tied: bool, dropout: float):
    """test_schedule.py's model (local spec, RMSNorm, GQA, SwiGLU, RoPE), Megatron's own init."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "test_schedule.py")
    spec = importlib.util.spec_from_file_location("_megatron_test_schedule", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.tiny_gpt(tied, dropout=dropout), module.V_PAD


def _forward_backward(model, vocab):
    """One training pass of Megatron's schedule over N_MICRO micro-batches; the last
    stage's per-micro-batch losses."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    ids = torch.randint(0, vocab, (N_MICRO, MICRO, SEQ), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(SEQ).expand(MICRO, -1)
    mask = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1).view(1, 1, SEQ, SEQ)

    def loss_func(logits):
        loss = logits.float().square().mean()
        return loss, {"loss": loss.detach()}

    def forward_step(data_iterator, chunk):
        return chunk(next(data_iterator), pos, mask), loss_func

    losses = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(ids),
        model=[model],
        num_microbatches=N_MICRO,
        seq_length=SEQ,
        micro_batch_size=MICRO,
        forward_only=False,
    )
    return [float(d["loss"]) for d in losses]


def _rank_forward_backward(rank):
    from megatron.core import parallel_state as ps

    from nemo_d3s.backends.megatron.cpu_compat import apply_cpu_compat, seed_model_parallel

    apply_cpu_compat()
    seed_model_parallel(1234)
    before = _torch_objects()
    model, vocab = _tiny_gpt(tied=True, dropout=0.1)
    # the first stage's embedding and the last stage's copy of it (PP2: all-reduced at build)
    tied = {
        k: v.detach().clone()
        for k, v in model.named_parameters()
        if k in ("embedding.word_embeddings.weight", "output_layer.weight")
    }
    losses = _forward_backward(model, vocab)
    grads = {k: p.grad for k, p in model.named_parameters()}
    return {
        "pp_rank": ps.get_pipeline_model_parallel_rank(),
        "losses": losses,
        "tied": tied,
        "devices": {p.device.type for p in model.parameters()},
        "grads_ok": {
            k: g is not None and bool(torch.isfinite(g).all()) and float(g.abs().sum()) > 0
            for k, g in grads.items()
        },
        "torch_untouched": all(a is b for a, b in zip(before, _torch_objects())),
    }


def _rank_recompute(rank):
    """Gradients with full activation recompute (one layer at a time) == without: the
    recomputed forward replays the same dropout masks (CPU generator + tracker states)."""
    from nemo_d3s.backends.megatron.cpu_compat import apply_cpu_compat, seed_model_parallel

    apply_cpu_compat()
    model, vocab = _tiny_gpt(tied=True, dropout=0.1)
    grads = {}
    for recompute in (None, "full"):
        model.config.recompute_granularity = recompute
        model.config.recompute_method = "uniform" if recompute else None
        model.config.recompute_num_layers = 1 if recompute else None
        model.zero_grad(set_to_none=True)
        seed_model_parallel(1234)
        _forward_backward(model, vocab)
        grads[recompute] = {k: p.grad.clone() for k, p in model.named_parameters()}
    return grads


def _rank_seeding(rank):
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    from nemo_d3s.backends.megatron.cpu_compat import apply_cpu_compat, seed_model_parallel

    out = {}
    if not torch.cuda.is_available():
        try:
            seed_model_parallel(1234)
        except RuntimeError:
            out["raises_before_apply"] = True
    apply_cpu_compat()

    def draws():
        seed_model_parallel(1234)
        outside = torch.rand(4)
        with get_cuda_rng_tracker().fork():
            inside = torch.rand(4)
        return outside, inside, torch.rand(4)

    outside, inside, after = draws()
    default = torch.Generator().manual_seed(1234)
    out["outside_is_seed"] = torch.equal(outside, torch.rand(4, generator=default))
    out["fork_leaves_outer_stream"] = torch.equal(after, torch.rand(4, generator=default))
    out["inside"] = inside
    out["reproducible"] = all(torch.equal(a, b) for a, b in zip((outside, inside, after), draws()))
    return out


# ---------------------------------------------------------------------------- tests
@pytest.mark.distributed
def test_apply_is_idempotent_and_leaves_torch_alone():
    (res,) = run_ranks(_rank_idempotent, 1, timeout=WAIT_S)
    assert res == {
        "applied_before": False,
        "same_after_second_apply": True,
        "modules_proxied": True,
        "wrapped_once": True,
        "torch_untouched": True,
        "applied_after": True,
        "proxy_stream_waits_nothing": True,
        "torch_stream_still_cuda": True,
        "unseeded_fork": True,
    }


@pytest.mark.distributed
@pytest.mark.parametrize("tp,pp", [(1, 2), (2, 1)], ids=["pp2", "tp2"])
def test_gpt_forward_backward_on_cpu(tp, pp):
    results = run_ranks(_rank_forward_backward, 2, tp=tp, pp=pp, timeout=WAIT_S)
    for res in results:
        assert res["devices"] == {"cpu"}
        assert res["torch_untouched"]
        assert res["grads_ok"] and all(res["grads_ok"].values()), res["grads_ok"]
    last = [r for r in results if r["pp_rank"] == pp - 1]
    for res in last:
        assert len(res["losses"]) == N_MICRO and all(0 < x < float("inf") for x in res["losses"])
    if pp == 2:  # the last stage's copy of the embedding equals the first stage's after the build
        first, last_ = (next(r for r in results if r["pp_rank"] == k) for k in (0, 1))
        emb = first["tied"]["embedding.word_embeddings.weight"]
        assert float(emb.abs().sum()) > 0
        assert torch.equal(last_["tied"]["output_layer.weight"], emb)


@pytest.mark.distributed
def test_activation_recompute_replays_dropout():
    for grads in run_ranks(_rank_recompute, 2, tp=2, timeout=WAIT_S):
        assert grads[None].keys() == grads["full"].keys()
        for name, g in grads[None].items():
            torch.testing.assert_close(
                grads["full"][name], g, rtol=0, atol=1e-7, msg=lambda m: f"{name}: {m}"
            )


@pytest.mark.distributed
def test_seed_model_parallel_gives_per_tp_rank_streams():
    results = run_ranks(_rank_seeding, 2, tp=2, timeout=WAIT_S)
    for res in results:
        assert res.get("raises_before_apply", torch.cuda.is_available())
        assert res["outside_is_seed"] and res["fork_leaves_outer_stream"] and res["reproducible"]
    # the tensor-parallel state differs between the TP ranks (seed + 2718 + tp_rank)
    assert not torch.equal(results[0]["inside"], results[1]["inside"])
