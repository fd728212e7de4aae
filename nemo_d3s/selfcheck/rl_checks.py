"""The trainer end to end on the Megatron backend, and its checkpoints. ``rl.megatron_step``:
two smoke steps at TP2 (TP1 on one rank) and a checkpoint; passes when an optimizer step was
taken, loss and grad norm are finite and the checkpoint verifies; feeds ``gpu.*``.
``checkpoint.roundtrip``: the sharded checkpoint saved, loaded at the same layout and TP1,
and converted to HF: every tensor equal to the live weights, bit for bit. On CUDA without
Transformer Engine both use the local spec and say so (the TE checks report the absence).
"""

from __future__ import annotations

import math
import shutil
from typing import Any, Dict, List

import torch

from nemo_d3s.selfcheck.base import Check, Context, megatron_backend, run_transformer_impl
from nemo_d3s.selfcheck.model_checks import one_step
from nemo_d3s.selfcheck.report import CheckFailed

__all__ = ["CHECKS", "rl_overrides", "run_rl"]


def rl_overrides(ctx: Context, out_dir: str, *, steps: int = 2, extra: List[str] = ()) -> List[str]:
    """The trainer overrides of the self-check's RL run (Hydra syntax)."""
    return [
        "experiment=smoke",
        "model.backend=megatron",
        "~model.params.tiny",
        f"model.name={ctx.model_dir}",
        f"+model.params.tensor_model_parallel_size={ctx.tp}",
        f"model.device={'cuda' if ctx.cuda else 'cpu'}",
        "model.dtype=auto",
        f"trainer.steps={steps}",
        "trainer.eval_at_start=false",
        "trainer.eval_every=0",
        f"trainer.save_every={steps}",  # one checkpoint: the shared hashing on the job's backend
        "trainer.export_hf=false",
        "task.eval_size=4",
        "logging.level=WARNING",
        f"output_dir={out_dir}",
        f"++model.params.transformer_impl={run_transformer_impl(ctx)[0]}",
        *extra,
    ]


def run_rl(ctx: Context, name: str, extra: List[str] = ()) -> Dict[str, Any]:
    """Train with :func:`rl_overrides`; the last metrics row, the config, and (CUDA) this
    rank's peak of reserved memory during the run."""
    from nemo_d3s.train import compose_config
    from nemo_d3s.trainer.loop import train
    from nemo_d3s.trainer.metrics import read_jsonl

    out = ctx.work_dir / name
    if ctx.rank == 0 and out.exists():
        shutil.rmtree(out)
    ctx.barrier()
    cfg = compose_config(rl_overrides(ctx, str(out), extra=list(extra)))
    if ctx.cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(ctx.device)
    train(cfg)
    # reserved, not allocated: what the caching allocator holds is what the GPU cannot give
    # vLLM (torch 2.13 torch/cuda/memory.py:380 reset_peak_memory_stats, :586 max_memory_reserved)
    peak = torch.cuda.max_memory_reserved(ctx.device) if ctx.cuda else None
    # allocated vs reserved: what the dry run's fragmentation term assumes (torch/cuda/memory.py
    # max_memory_allocated)
    allocated = torch.cuda.max_memory_allocated(ctx.device) if ctx.cuda else None
    ctx.barrier()
    rows = read_jsonl(out / "metrics.jsonl")
    if not rows:
        raise CheckFailed(f"the run wrote no metrics row ({out / 'metrics.jsonl'})")
    return {
        "last": rows[-1],
        "rows": len(rows),
        "cfg": cfg,
        "peak_reserved_bytes": peak,
        "peak_allocated_bytes": allocated,
    }


def check_rl_step(ctx: Context) -> Dict[str, Any]:
    res = run_rl(ctx, "rl")
    ctx.cache["rl"] = res
    last = res["last"]
    impl, why = run_transformer_impl(ctx)
    out = {"tp": ctx.tp, "ranks": ctx.world, "steps": res["rows"], "transformer_impl": impl}
    if why:
        out["note"] = why
    for k in ("optimizer_steps", "loss", "grad_norm", "reward_mean", "kept_tokens", "time_step"):
        if k in last:
            out[k] = last[k]
    from nemo_d3s.trainer.checkpoint import checkpoint_dirs, verify_checkpoint

    saved = checkpoint_dirs(ctx.work_dir / "rl" / "checkpoints")
    # every rank hashed its files when saving and its share now; the findings gathered
    # (NCCL on CUDA: the digests travel as byte tensors on the GPU)
    out["checkpoint"] = saved[0].name if saved else "none"
    why = verify_checkpoint(saved[0], shared=True) if saved else "no checkpoint written"
    if why is not None:
        raise CheckFailed(f"the run's checkpoint: {why}", out)
    if not last.get("optimizer_steps", 0) > 0:
        why = "no optimizer step was taken"
        if last.get("skip_all_equal"):  # seen with random weights at a real width on an H200
            why += (
                ": every group's rewards were equal (the model earned the same reward on every"
                " rollout of the smoke task), so there was no gradient; a model that scores"
                " unevenly there, or the tiny model (no --model), checks the update"
            )
        elif last.get("skipped_nonfinite"):  # the backend applied no update
            why += ": the gradient norm was not finite"
        raise CheckFailed(why, out)
    bad = [k for k in ("loss", "grad_norm") if k in last and not math.isfinite(float(last[k]))]
    if bad:
        raise CheckFailed(f"non-finite {bad}", out)
    return out


def _differences(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor], what: str) -> List[str]:
    if set(a) != set(b):
        return [f"{what}: other tensor names: {sorted(set(a) ^ set(b))[:4]}"]
    bad = [
        k
        for k in a
        if a[k].shape != b[k].shape or a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])
    ]
    return (
        [f"{what}: {len(bad)} tensors differ from the live weights (e.g. {bad[0]})"] if bad else []
    )


def check_checkpoint(ctx: Context) -> Dict[str, Any]:
    from safetensors.torch import load_file

    from nemo_d3s.convert import megatron_to_hf

    folder, hf_out = ctx.work_dir / "ckpt", ctx.work_dir / "ckpt_hf"
    if ctx.rank == 0:
        for f in (folder, hf_out):
            shutil.rmtree(f, ignore_errors=True)
    ctx.barrier()
    impl = run_transformer_impl(ctx)[0]
    with megatron_backend(
        ctx, tensor_model_parallel_size=ctx.tp, lr=1e-2, transformer_impl=impl
    ) as pol:
        one_step(pol)
        live = {k: v.detach().cpu().clone() for k, v in pol.hf_weights()}
        pol.save_checkpoint(str(folder))
        ctx.barrier()
    layouts = [ctx.tp] + ([1] if ctx.tp > 1 else [])
    problems: List[str] = []
    for tp in layouts:
        with megatron_backend(ctx, tensor_model_parallel_size=tp, transformer_impl=impl) as pol:
            pol.load_checkpoint(str(folder))
            loaded = {k: v.detach().cpu().clone() for k, v in pol.hf_weights()}
            problems += _differences(live, loaded, f"loaded at TP{tp}")
    if ctx.rank == 0:
        try:
            # a bare backend save has no checksums.json (the trainer's CheckpointManager writes
            # it, and rl.megatron_step checks that path): the converter is told so
            megatron_to_hf(
                str(folder),
                str(hf_out),
                hf_config=str(ctx.model_dir),
                progress=False,
                verify_checksums=False,
            )
            files = sorted(hf_out.glob("*.safetensors"))
            problems += _differences(
                live, {k: v for f in files for k, v in load_file(str(f)).items()}, "megatron_to_hf"
            )
        except Exception as e:  # reported on every rank by agree()
            problems.append(f"megatron_to_hf: {type(e).__name__}: {e}")
    out = {
        "tensors": len(live),
        "saved_tp": ctx.tp,
        "loaded_at_tp": layouts,
        "bytes": sum(t.numel() * t.element_size() for t in live.values()),
    }
    ctx.agree(problems, out)
    return out


CHECKS = [
    Check("rl.megatron_step", False, check_rl_step),
    Check("checkpoint.roundtrip", False, check_checkpoint),
]
