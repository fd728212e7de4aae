"""The pipeline paths of the 70B set-up, on CUDA and through their CPU twins.

The 70B recipes train with the Transformer Engine spec in bf16, Megatron's distributed
optimizer, pipeline parallelism, sequence parallelism and full activation recompute; the
interleaved pipeline needs a model whose layers divide by PP x VPP, which the self-check's
2-layer model does not. These checks reach both, each with the same comparison as
``gpt.local_spec`` / ``gpt.te_spec`` (``model_checks``: one GRPO step, log-probs, grad norm,
weights after the step, against TP1 x PP1):

- ``gpt.pp_recompute`` (CPU twin, any device): fp32 local spec with full recompute at PP2
  (and TP2 x PP2 with sequence parallelism on a multiple of 4 ranks) against TP1 x PP1
  without recompute, within ``gpt.local_spec``'s bounds (fp32: recompute changes no number).
- ``gpt.te_spec_pp_recompute`` (CUDA): the same layout in bf16 with the TE spec and the
  distributed optimizer against the fp32 local spec at TP1, within ``gpt.te_spec``'s bounds.
- ``gpt.interleaved_pipeline`` (CPU twin): the interleaved 1F1B schedule at PP2 x VPP2 on a
  4-layer model (the tiny model built again with 4 layers; ``--model`` when its layers divide
  by 4) against TP1 x PP1, fp32 local spec, ``gpt.local_spec``'s bounds.
- ``gpt.te_spec_interleaved`` (CUDA): PP2 x VPP2 with the TE spec, bf16, distributed
  optimizer (one DDP bucket per chunk) on the same 4-layer model, ``gpt.te_spec``'s bounds.
- ``gpt.bf16_plain_adamw`` (CUDA): ``gpt.te_spec`` with ``distributed_optimizer=false``:
  plain AdamW on fp32 main weights, gradients accumulated and all-reduced in fp32
  (``main_weights``: ``main_grad``); its CPU twin is the gloo test of the DP all-reduce
  (``tests/backends/megatron/test_main_weights.py``).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Dict

from nemo_d3s.selfcheck.base import Check, Context, build_tiny_model, need_world
from nemo_d3s.selfcheck.model_checks import compare_layouts, check_te_spec
from nemo_d3s.selfcheck.report import NotRun

__all__ = ["CHECKS", "deep_model"]

INTERLEAVED = dict(tp=1, pp=2, virtual_pipeline_model_parallel_size=2)


def _layers(ctx: Context) -> int:
    return int(json.loads((ctx.model_dir / "config.json").read_text())["num_hidden_layers"])


def deep_model(ctx: Context, multiple: int = 4) -> Context:
    """``ctx`` on a model whose layers divide by ``multiple``: its own model when they do,
    else the tiny model built with ``multiple`` layers (rank 0 builds it once; collective)."""
    if _layers(ctx) % multiple == 0:
        return ctx
    if not ctx.tiny:
        raise NotRun(
            f"--model has {_layers(ctx)} layers: PP2 x VPP2 needs a multiple of {multiple}"
        )
    folder = ctx.work_dir / f"tiny_model_{multiple}_layers"
    if ctx.rank == 0 and not (folder / "config.json").is_file():
        build_tiny_model(folder, num_hidden_layers=multiple)
    ctx.barrier()
    return dataclasses.replace(ctx, model_dir=folder)


def _pp_recompute_layout(ctx: Context) -> Dict[str, Any]:
    """TP2 x PP2 with SP on a multiple of 4 ranks, else PP2; full recompute."""
    need_world(ctx, 2, "the pipeline (PP 2)")
    if _layers(ctx) % 2:
        raise NotRun(f"the model's {_layers(ctx)} layers do not split over PP 2")
    if ctx.world % 4 == 0:
        return dict(tp=2, pp=2, sequence_parallel=True, gradient_checkpointing=True)
    return dict(tp=1, pp=2, gradient_checkpointing=True)


def check_pp_recompute(ctx: Context) -> Dict[str, Any]:
    layout = _pp_recompute_layout(ctx)
    name = f"tp{layout['tp']}pp2{'_sp' if layout['tp'] > 1 else ''}_recompute"
    return compare_layouts(ctx, {name: layout})


def check_te_spec_pp_recompute(ctx: Context) -> Dict[str, Any]:
    layout = _pp_recompute_layout(ctx)
    tp, pp = layout.pop("tp"), layout.pop("pp")
    return check_te_spec(ctx, tp=tp, pp=pp, **layout)


def check_interleaved(ctx: Context) -> Dict[str, Any]:
    need_world(ctx, 2, "the interleaved pipeline (PP 2 x VPP 2)")
    deep = deep_model(ctx)
    out = compare_layouts(deep, {"pp2_vpp2": dict(INTERLEAVED)})
    return {"layers": _layers(deep), **out}


def check_te_spec_interleaved(ctx: Context) -> Dict[str, Any]:
    need_world(ctx, 2, "the interleaved pipeline (PP 2 x VPP 2)")
    deep = deep_model(ctx)
    return {
        "layers": _layers(deep),
        **check_te_spec(
            deep,
            tp=1,
            pp=2,
            virtual_pipeline_model_parallel_size=2,
        ),
    }


def check_bf16_plain_adamw(ctx: Context) -> Dict[str, Any]:
    return check_te_spec(ctx, distributed_optimizer=False)


CHECKS = [
    Check("gpt.pp_recompute", False, check_pp_recompute),
    Check(
        "gpt.te_spec_pp_recompute",
        True,
        check_te_spec_pp_recompute,
        "the 70B set-up: Transformer Engine spec, bf16, distributed optimizer, full recompute "
        "at TP2 x PP2 with sequence parallelism (PP2 on 2 GPUs) against the fp32 local spec "
        "at TP1; CPU twin gpt.pp_recompute",
    ),
    Check("gpt.interleaved_pipeline", False, check_interleaved),
    Check(
        "gpt.te_spec_interleaved",
        True,
        check_te_spec_interleaved,
        "interleaved 1F1B at PP2 x VPP2 (a 4-layer model) with the Transformer Engine spec, "
        "bf16 and the distributed optimizer against the fp32 local spec at TP1; CPU twin "
        "gpt.interleaved_pipeline",
    ),
    Check(
        "gpt.bf16_plain_adamw",
        True,
        check_bf16_plain_adamw,
        "the Transformer Engine spec in bf16 with plain AdamW (distributed_optimizer=false): "
        "fp32 main weights and fp32 main_grad accumulation / DP all-reduce, against the fp32 "
        "local spec at TP1",
    ),
]
