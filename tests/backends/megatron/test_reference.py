"""The Megatron backend's frozen reference policy (``use_reference``, i.e. ``algorithm.kl_coef
> 0``) on gloo ranks: it is built as a second stage (a ``copy.deepcopy`` of a megatron-core
module fails on its ProcessGroup handles), starts equal to the policy, and does not move
when the policy trains."""

from __future__ import annotations

import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "distributed"))
from _launch import run_ranks  # noqa: E402
from _tiny_hf import tiny_batch  # noqa: E402
from _limits import WAIT_S  # noqa: E402

pytestmark = pytest.mark.distributed


def _named(model):
    """(chunk index, name) -> parameter over a stage or a virtual pipeline's chunks."""
    chunks = model if isinstance(model, list) else [model]
    return {(i, n): p for i, c in enumerate(chunks) for n, p in c.named_parameters()}


def _rank_reference(rank, folder, tp, pp=1, vpp=None):
    from nemo_d3s.backends.megatron.backend import MegatronBackend
    from nemo_d3s.backends.megatron.config import MegatronBackendConfig
    from nemo_d3s.core.losses import LossConfig, loss_denominator
    from nemo_d3s.trainer.update import UpdateBatch, make_loss_fn

    batch, adv, noise, keep = tiny_batch()
    pol = MegatronBackend(
        MegatronBackendConfig(
            model=folder,
            device="cpu",
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vpp,
            use_reference=True,
            lr=1e-2,
            grad_clip=0.0,
        )
    )
    ref_params = _named(pol.ref_model)
    assert set(ref_params) == set(_named(pol.model))
    shared = [n for n, p in _named(pol.model).items() if p.data_ptr() == ref_params[n].data_ptr()]
    before = pol.score(batch, with_entropy=False, micro_batch_size=2).logprobs
    ref_before = pol.score(batch, with_entropy=False, reference=True, micro_batch_size=2).logprobs
    upd = UpdateBatch(
        batch=batch,
        old_logprobs=before + noise,
        advantages=adv,
        token_keep=keep,
        minibatch=torch.zeros(len(batch), dtype=torch.long),
    )
    pol.train_step(
        batch,
        make_loss_fn("grpo", LossConfig(check_inputs=False), upd),
        2,
        denominator=float(loss_denominator(keep, "token_mean")),
    )
    after = pol.score(batch, with_entropy=False, micro_batch_size=2).logprobs
    ref_after = pol.score(batch, with_entropy=False, reference=True, micro_batch_size=2).logprobs
    return {
        "shared": shared,
        "before": before,
        "ref_before": ref_before,
        "after": after,
        "ref_after": ref_after,
        "ref_requires_grad": any(p.requires_grad for p in ref_params.values()),
    }


@pytest.mark.parametrize(
    "tp,pp,vpp", [(1, 1, None), (2, 1, None), (1, 2, 2)], ids=["tp1", "tp2", "pp2vpp2"]
)
def test_reference_policy_is_a_frozen_copy(folders, tp, pp, vpp):
    """(PP2 x VPP2: one reference chunk per policy chunk; the backend builds its groups)"""
    results = run_ranks(
        _rank_reference,
        tp * pp,
        folders["llama"],
        tp,
        pp,
        vpp,
        tp=tp,
        pp=pp,
        megatron=vpp is None,
        timeout=WAIT_S,
    )
    for res in results:
        assert res["shared"] == [] and not res["ref_requires_grad"]
        assert torch.equal(res["ref_before"], res["before"])
        assert torch.equal(res["ref_after"], res["before"])  # the reference does not train
        assert (res["after"] - res["before"]).abs().max() > 1e-4  # the policy does
