"""Megatron-core backend (``model.backend=megatron``): a ``GPTModel`` sharded over tensor,
pipeline and data parallelism, trained through Megatron's own schedules.

The only package besides ``backends.hf`` / ``backends.vllm`` that imports a model framework;
nothing outside ``nemo_d3s/backends/megatron/`` imports megatron-core. Modules:
``hf_config`` (config.json -> ModelSpec), ``weights`` (the one HF <-> Megatron name/shape
table), ``model`` (build, load, gather), ``schedule`` (score / train_step), ``optimizer``
(both optimizers, the plain one's gradient steps, the distributed optimizer's checkpoint
state), ``engine`` (rollouts per model-parallel group), ``checkpoint`` (sharded,
reshardable), ``nemo2`` / ``nemo2_writer`` (NeMo 2 checkpoints), ``parallel`` (process groups, rank order),
``cpu_compat`` (megatron-core on gloo/CPU), ``backend`` (the Policy).
"""


def __getattr__(name):
    # Importing megatron-core takes seconds; only a run that uses this backend pays for it.
    if name == "MegatronBackend":
        from nemo_d3s.backends.megatron.backend import MegatronBackend

        return MegatronBackend
    raise AttributeError(name)
