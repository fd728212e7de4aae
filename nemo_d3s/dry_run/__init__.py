"""``trainer.dry_run=true``: prove a Megatron layout on a laptop before queueing for it.

The config is resolved, every divisibility rule checked and each distinct (TP, PP) stage built
on the meta device (``model.name`` may hold only ``config.json``); the per-GPU memory the run
needs on CUDA is printed against ``trainer.gpu_memory_gb`` and written to
``output_dir/dry_run.json``. Returns 0 (fits) or 1, or raises ConfigError (the layout cannot
run). Nothing is trained, no process group is created, no weight is read.
"""

from __future__ import annotations

import json
from typing import Any

from nemo_d3s.files import atomic_write_text
from nemo_d3s.dry_run.memory import (
    CUDA_CONTEXT_BYTES,
    GB,
    Workload,
    activation_bytes,
    kv_bytes_per_token,
    layer_activation_bytes,
    logits_bytes,
    megatron_lm_reference,
    nccl_bytes,
    physical_gpu_bytes,
    vllm_activation_bytes,
)
from nemo_d3s.dry_run.plan import plan
from nemo_d3s.dry_run.report import render
from nemo_d3s.dry_run.shape import JobShape, job_shape, model_folder

__all__ = [
    "GB",
    "CUDA_CONTEXT_BYTES",
    "nccl_bytes",
    "physical_gpu_bytes",
    "JobShape",
    "Workload",
    "job_shape",
    "model_folder",
    "layer_activation_bytes",
    "activation_bytes",
    "logits_bytes",
    "kv_bytes_per_token",
    "vllm_activation_bytes",
    "megatron_lm_reference",
    "plan",
    "render",
    "dry_run",
]


def dry_run(cfg: Any) -> int:
    """Print the plan's table and write ``output_dir/dry_run.json``; 0 when it fits, 1 when not
    (ConfigError when the layout cannot run at all).
    """
    from nemo_d3s.trainer.run_start import check_output_dir

    out = check_output_dir(str(cfg.output_dir))
    report = plan(cfg)
    print(render(report), flush=True)
    atomic_write_text(out / "dry_run.json", json.dumps(report, indent=2) + "\n")
    print(f"wrote {out / 'dry_run.json'}", flush=True)
    return 0 if report["fits"] else 1
