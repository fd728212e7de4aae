"""The pipeline paths of the 70B set-up (TE spec, bf16, distributed optimizer, PP, SP, full
recompute, interleaved 1F1B), each compared with TP1 x PP1 as in ``model_checks``:
``gpt.pp_recompute`` and ``gpt.interleaved_pipeline`` (CPU twins, fp32, a 4-layer model for
PP2 x VPP2) within ``gpt.local_spec``'s bounds; ``gpt.te_spec_pp_recompute``,
``gpt.te_spec_interleaved`` and ``gpt.bf16_plain_adamw`` (CUDA) within ``gpt.te_spec``'s.
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
