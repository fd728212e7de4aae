"""``trainer.dry_run=true``: prove a Megatron layout on a laptop before queueing for it.

``python -m nemo_d3s.train experiment=llama3_70b trainer.dry_run=true`` (the recipe states its
cluster shape; ``NNODES`` and ``GPUS_PER_NODE`` plan another) resolves the config, checks every
divisibility rule of the layout, builds this model's stage for each distinct (TP, PP) position on
the meta device (no memory, no weights: ``model.name`` may be a folder holding only
``config.json``), and prints, per GPU, the memory the run will need against
``trainer.gpu_memory_gb``, with a verdict and the largest term named. It writes
``output_dir/dry_run.json`` and returns 0 (fits), 1 (does not fit) or raises
:class:`~nemo_d3s.errors.ConfigError` (the layout cannot run at all: exit 2 from the CLI).
Nothing is trained, no process group is created, no weight is read. The plan is for CUDA
(``model.dtype=auto`` is bf16 there), wherever the dry run itself runs.

The job's shape: ``NNODES`` x ``GPUS_PER_NODE`` (what ``slurm/train_megatron.sbatch`` exports),
else ``SLURM_JOB_NUM_NODES`` x ``SLURM_GPUS_ON_NODE``, else the recipe's ``trainer.nodes`` x
``trainer.gpus_per_node``, else 1 x 8.

Parts: ``shape.py`` (the job's shape, the model folder, the checked layout), ``plan.py``
(config -> layout -> per-GPU terms), ``memory.py`` (the memory model: what a GPU holds, as
formulas), ``report.py`` (the cross-checks, the verdict, the report and its table).
"""

from __future__ import annotations

import json
import os
from typing import Any

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
    """Run the dry run for a resolved config: print the table, write
    ``output_dir/dry_run.json``; 0 when it fits, 1 when it does not (ConfigError when the
    layout cannot run at all)."""
    from nemo_d3s.trainer.rundir import check_output_dir

    out = check_output_dir(str(cfg.output_dir))
    report = plan(cfg)
    print(render(report), flush=True)
    tmp = out / f".dry_run.json.tmp-{os.getpid()}"  # a reader never sees half a file
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    os.replace(tmp, out / "dry_run.json")
    print(f"wrote {out / 'dry_run.json'}", flush=True)
    return 0 if report["fits"] else 1
