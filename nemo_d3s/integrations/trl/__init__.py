"""D3S / PODS inside TRL's ``GRPOTrainer`` (optional extra: ``pip install -e ".[trl]"``):
``D3SGRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...), train_dataset=..., d3s="d3s")``
with the presets of ``python -m nemo_d3s.train d3s=<name>``. Untested TRL releases are refused
unless ``NEMO_D3S_ALLOW_UNTESTED=1`` (``nemo_d3s/versions.py``)."""

__all__ = ["D3SGRPOTrainer", "resolve_d3s"]


def __getattr__(name):
    # Lazy: the selection glue imports without TRL installed.
    if name in ("D3SGRPOTrainer", "resolve_d3s"):
        from nemo_d3s.integrations.trl import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
