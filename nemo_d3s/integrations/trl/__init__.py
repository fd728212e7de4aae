"""D3S / PODS inside TRL's ``GRPOTrainer`` (optional extra: ``pip install -e ".[trl]"``).

::

    from nemo_d3s.integrations.trl import D3SGRPOTrainer
    trainer = D3SGRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...),
                             train_dataset=..., d3s="d3s")   # or grpo, pods, d1s, d1s_cross, d3s_i
    trainer.train()

The presets are ``nemo_d3s.core.presets.PRESETS`` (the same keys and schedules as
``python -m nemo_d3s.train d3s=<name>``). ``trainer.py`` says where it hooks TRL;
``selection.py`` is the TRL-free glue to the project's selector. The tested TRL range is
``nemo_d3s/versions.py``'s, beside torch's and megatron-core's: other releases are refused
with one line unless ``NEMO_D3S_ALLOW_UNTESTED=1``.
"""

__all__ = ["D3SGRPOTrainer", "resolve_d3s"]


def __getattr__(name):
    # Lazy: the selection glue imports without TRL installed.
    if name in ("D3SGRPOTrainer", "resolve_d3s"):
        from nemo_d3s.integrations.trl import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
