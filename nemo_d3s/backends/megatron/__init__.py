"""Megatron-core backend (``model.backend=megatron``): a ``GPTModel`` sharded over tensor,
pipeline and data parallelism, trained through Megatron's own schedules.

The only package besides ``backends.hf`` / ``backends.vllm`` that imports a model framework;
nothing outside ``nemo_d3s/backends/megatron/`` imports megatron-core. What a checkpoint
folder holds (config.json -> ModelSpec, the HF <-> Megatron weight table, the shard files,
NeMo 2 reading) is the file-format layer below, ``nemo_d3s/formats``. Modules: ``model``
(build, load, gather), ``schedule`` (score / train_step), ``optimizer`` (both optimizers,
the plain one's gradient steps, the distributed optimizer's checkpoint state), ``engine``
(rollouts per model-parallel group), ``checkpoint`` (the running policy's save / load with
its optimizer, any layout), ``nemo2_writer`` (NeMo 2 checkpoints, through megatron-core's
dist_checkpointing), ``param_counts`` (the dry run's meta-device build), ``parallel``
(process groups, rank order), ``cpu_compat`` (megatron-core on gloo/CPU), ``config`` (the
typed config and its option check), ``prepare`` (the backend's set-up steps: dtype, model
folder, weights reader, process groups, seeding, LR schedule), ``backend`` (the Policy).
"""

import logging as _logging
import warnings as _warnings

# Start-up notices of megatron-core that a user cannot act on, silenced here because every
# submodule that imports megatron-core is imported through this package: the optional CUDA
# extensions (Transformer Engine, Apex) being absent (on CPU they cannot be used; on CUDA the
# backend refuses to run without Transformer Engine unless asked), the deprecation of
# megatron-core's own default cuda_graph_scope="full" (transformer_config.py, warned on every
# TransformerConfig), and Megatron-FSDP's INFO lines at import (this backend does not use
# FSDP). Each filter matches one message from megatron.core's modules; other warnings show.
for _message in (
    r"Transformer Engine and Apex are not installed",
    r"Apex is not installed",
    r"full scope is deprecated",
):
    _warnings.filterwarnings(
        "ignore", message=_message, category=UserWarning, module=r"megatron\.core"
    )
_logging.getLogger("megatron.core.distributed.fsdp").setLevel(_logging.WARNING)


def __getattr__(name):
    # Importing megatron-core takes seconds; only a run that uses this backend pays for it.
    if name == "MegatronBackend":
        from nemo_d3s.backends.megatron.backend import MegatronBackend

        return MegatronBackend
    raise AttributeError(name)
