"""Mixture-of-experts checkpoints through the converter: a tiny random Qwen3-MoE, a tiny Mixtral
and a tiny Qwen2-MoE (a shared expert; transformers' own classes, 4 experts) convert HF ->
Megatron at EP 2 (and TP 2 x EP 2 x ETP 1, PP 2 x EP 4) -> HF bit for bit, in float32 and
bfloat16; the expert files hold what the weight table says; ``verify`` passes on the EP 2
checkpoint; an EP the experts do not divide is refused before anything is written."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _models import assert_same_tensors, hf_tensors, tiny  # noqa: E402

from nemo_d3s.convert import hf_to_megatron, megatron_to_hf  # noqa: E402
from nemo_d3s.errors import ConfigError  # noqa: E402

LAYOUTS = {  # name: (tp, pp, ep, etp)
    "ep2": (1, 1, 2, None),
    "tp2ep2etp1": (2, 1, 2, 1),
    "pp2ep4": (1, 2, 4, None),
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "qwen2_moe"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_moe_round_trip_is_bit_exact(tmp_path, arch, dtype, layout):
    tp, pp, ep, etp = LAYOUTS[layout]
    src = tiny(tmp_path / "src", arch, dtype)
    ck = hf_to_megatron(src, tmp_path / "ck", tp=tp, pp=pp, ep=ep, etp=etp, progress=False)
    saved = json.loads((ck / "megatron" / "layout.json").read_text())
    etp = tp if etp is None else etp
    assert (saved["tp"], saved["pp"], saved["ep"], saved["etp"]) == (tp, pp, ep, etp)
    assert sorted(os.listdir(ck / "megatron")) == sorted(
        ["layout.json"]
        + [f"tp{t:02d}_pp{p:02d}.safetensors" for t in range(tp) for p in range(pp)]
        + [
            f"ep{e:02d}_etp{t:02d}_pp{p:02d}.safetensors"
            for e in range(ep)
            for t in range(etp)
            for p in range(pp)
        ]
    )
    back = megatron_to_hf(ck, tmp_path / "back", progress=False)
    assert_same_tensors(src, back)
    assert (back / "config.json").read_bytes() == (src / "config.json").read_bytes()


def test_expert_files_hold_the_experts_of_their_rank(tmp_path):
    """EP rank e holds experts [2e, 2e + 2) as local experts 0, 1: fc1 = [gate; up] rows,
    fc2 = down, read from the HF tensors by hand; dense files hold no expert."""
    from safetensors.torch import load_file

    src = tiny(tmp_path / "src", "qwen3_moe")
    ck = hf_to_megatron(src, tmp_path / "ck", ep=2, progress=False)
    hf = hf_tensors(src)
    dense = load_file(str(ck / "megatron" / "tp00_pp00.safetensors"))
    assert not [k for k in dense if ".experts." in k]
    assert torch.equal(
        dense["decoder.layers.1.mlp.router.weight"], hf["model.layers.1.mlp.gate.weight"]
    )
    for e in range(2):
        got = load_file(str(ck / "megatron" / f"ep{e:02d}_etp00_pp00.safetensors"))
        assert len(got) == 4 * 2 * 2  # 4 layers x 2 local experts x (fc1, fc2)
        for layer in range(4):
            for k in range(2):
                x = f"model.layers.{layer}.mlp.experts.{2 * e + k}."
                m = f"decoder.layers.{layer}.mlp.experts.local_experts.{k}."
                fc1 = torch.cat([hf[x + "gate_proj.weight"], hf[x + "up_proj.weight"]])
                assert torch.equal(got[m + "linear_fc1.weight"], fc1)
                assert torch.equal(got[m + "linear_fc2.weight"], hf[x + "down_proj.weight"])


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_verify_passes_on_an_ep2_checkpoint(tmp_path, arch):
    from nemo_d3s.convert.verify_logits import verify

    src = tiny(tmp_path / "src", arch)
    ck = hf_to_megatron(src, tmp_path / "ck", ep=2, progress=False)
    res = verify(src, ck)
    assert res.ok and res.max_abs_err <= 1e-4, res


def test_an_ep_the_experts_do_not_divide_is_refused_before_writing(tmp_path):
    src = tiny(tmp_path / "src", "qwen3_moe")
    with pytest.raises(
        ConfigError, match="num_experts=4 is not divisible by expert_model_parallel_size=3"
    ):
        hf_to_megatron(src, tmp_path / "ck", ep=3, progress=False)
    assert not (tmp_path / "ck").exists()
    with pytest.raises(ConfigError, match="has no experts"):
        hf_to_megatron(tiny(tmp_path / "dense", "llama"), tmp_path / "ck", ep=2, progress=False)


def test_the_smallest_world_of_an_expert_layout_is_an_lcm_not_a_max(tmp_path):
    """TP 2 with EP 3 x ETP 1 needs 6 ranks (TP x PP and ETP x EP x PP both divide the
    world): the converter checked the layout at max(2, 3) = 3 ranks and refused a valid one."""
    from nemo_d3s.formats.spec import ModelSpec, check_layout, smallest_world

    assert smallest_world(2, 1, 3, 1) == 6 and smallest_world(4, 1, 6, 1) == 12
    assert smallest_world(2, 2, 4, 1) == 8 and smallest_world(2, 3) == 6  # ETP = TP: TP x PP
    cfg = json.loads((tiny(tmp_path / "src", "qwen2_moe") / "config.json").read_text())
    spec = ModelSpec.from_hf_dict({**cfg, "num_experts": 6})
    assert check_layout(spec, tp=2, pp=1, world=smallest_world(2, 1, 3, 1), ep=3, etp=1) == 3
    with pytest.raises(ConfigError, match="world size 3 is not divisible"):
        check_layout(spec, tp=2, pp=1, world=max(2, 3), ep=3, etp=1)


@pytest.mark.parametrize("field,value", [("ep", 0), ("etp", -1), ("ep", 3)])
def test_expert_sizes_in_layout_json_are_checked(tmp_path, field, value):
    """A layout.json whose expert sizes are not a layout of the model (0: no expert file
    indexed, then a bare KeyError at another EP) is one error naming the file."""
    src = tiny(tmp_path / "src", "qwen3_moe")
    ck = hf_to_megatron(src, tmp_path / "ck", ep=2, progress=False)
    path = ck / "megatron" / "layout.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), field: value}))
    with pytest.raises(ConfigError, match="layout.json"):
        megatron_to_hf(ck, tmp_path / "back", progress=False, verify_checksums=False)
    assert not (tmp_path / "back").exists()
