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
typed config and its option check), ``backend`` (the Policy).
"""


def __getattr__(name):
    # Importing megatron-core takes seconds; only a run that uses this backend pays for it.
    if name == "MegatronBackend":
        from nemo_d3s.backends.megatron.backend import MegatronBackend

        return MegatronBackend
    raise AttributeError(name)
