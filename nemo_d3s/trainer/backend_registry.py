"""Which model framework runs the policy: name -> (Policy class, config dataclass), imported
lazily so only the backend a run uses is imported; ``pkg.module:Class`` names a class with a
``config_class`` attribute. The config is built from the common settings (``COMMON_SOURCES``)
plus ``model.params``: a common setting the dataclass lacks is logged, an unknown
``model.params`` key is an error. A class may declare ``check_config(config)`` (ValueError
naming the key); the build and the dry run both go through :func:`checked_config`.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
from typing import Any, Dict, Mapping, Tuple

from nemo_d3s.backends.base import Policy

log = logging.getLogger("nemo_d3s.trainer")

__all__ = ["BACKENDS", "backend_config", "build_backend", "checked_config", "resolve_backend"]

# name -> ("module:BackendClass", "module:ConfigDataclass").
BACKENDS: Dict[str, Tuple[str, str]] = {
    "hf": ("nemo_d3s.backends.hf:HFBackend", "nemo_d3s.backends.hf.config:HFBackendConfig"),
    "megatron": (
        "nemo_d3s.backends.megatron:MegatronBackend",
        "nemo_d3s.backends.megatron.config:MegatronBackendConfig",
    ),
}


def _import(target: str) -> Any:
    module_name, _, attr = target.partition(":")
    module = importlib.import_module(module_name)
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(f"module {module_name!r} has no attribute {attr!r}") from None


def resolve_backend(name: str) -> Tuple[type, type]:
    """(backend class, config dataclass) for ``name`` (a key of BACKENDS or module:Class)."""
    if name in BACKENDS:
        cls_path, cfg_path = BACKENDS[name]
        return _import(cls_path), _import(cfg_path)
    if ":" not in name:
        raise ValueError(
            f"model.backend={name!r}: unknown backend; known: {', '.join(sorted(BACKENDS))}, "
            "or a 'package.module:Class' path"
        )
    cls = _import(name)
    cfg_cls = getattr(cls, "config_class", None)
    if cfg_cls is None or not dataclasses.is_dataclass(cfg_cls):
        raise ValueError(
            f"model.backend={name!r}: the class needs a dataclass attribute 'config_class'"
        )
    return cls, cfg_cls


# Each common setting's one source in the run config: a model.params key of the same name
# would override it silently (``+model.params.lr`` against ``trainer.lr``), so it is refused,
# naming the key to set instead.
COMMON_SOURCES: Dict[str, str] = {
    "model": "model.name",
    "dtype": "model.dtype",
    "device": "model.device",
    "seed": "seed",
    "lr": "trainer.lr",
    "weight_decay": "trainer.weight_decay",
    "adam_betas": "trainer.adam_beta1 / trainer.adam_beta2",
    "grad_clip": "trainer.grad_clip",
    "warmup_steps": "trainer.warmup_steps",
    "scheduler": "trainer.lr_schedule",
    "total_steps": "trainer.steps (x trainer.num_mini_batches)",
    "use_reference": "algorithm.kl_coef (> 0 keeps a reference model)",
    "gradient_checkpointing": "model.gradient_checkpointing",
    "dist_timeout_minutes": "trainer.dist_timeout_minutes",
    "pack_sequences": "trainer.pack_sequences",
}


def backend_config(cfg_cls: type, common: Mapping[str, Any], params: Mapping[str, Any]) -> Any:
    """Build the backend's config dataclass from common settings + ``model.params``. A
    ``model.params`` key that is a common setting is refused (one source per setting)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    fields = {f.name for f in dataclasses.fields(cfg_cls)}
    for key in params:
        if key in common:
            source = COMMON_SOURCES.get(key, "the run config")
            raise ValueError(
                f"model.params.{key}: this setting comes from {source}; set it there (one "
                "source per setting), not in model.params"
            )
        if key not in fields:
            own = sorted(fields - set(common))
            raise ValueError(
                f"model.params.{key}: not a setting of {cfg_cls.__name__}; known: {', '.join(own)}"
            )
    unused = sorted(k for k, v in common.items() if k not in fields and v not in (None, False))
    if unused:
        log.info(
            "%s does not use the run settings %s",
            cfg_cls.__name__,
            ", ".join(f"{k}={common[k]!r}" for k in unused),
        )
    values = {k: v for k, v in common.items() if k in fields}
    values.update(params)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(cfg_cls), OmegaConf.create(dict(values)))
    except OmegaConfBaseException as e:
        raise ValueError(f"model.params: {e}") from None
    return OmegaConf.to_object(merged)


def checked_config(
    name: str, common: Mapping[str, Any], params: Mapping[str, Any]
) -> Tuple[type, Any]:
    """(backend class, its config) for ``name``, built and passed through the class's
    ``check_config``; ValueError naming the key otherwise. Nothing is built.
    """
    cls, cfg_cls = resolve_backend(name)
    config = backend_config(cfg_cls, common, params)
    check = getattr(cls, "check_config", None)
    if check is not None:
        check(config)
    return cls, config


def build_backend(name: str, common: Mapping[str, Any], params: Mapping[str, Any]) -> Policy:
    """Construct the policy ``name``; it builds its parallel layout (``policy.groups``)."""
    cls, config = checked_config(name, common, params)
    policy = cls(config)
    if not isinstance(policy, Policy):
        raise TypeError(
            f"backend {name!r} built a {type(policy).__name__}, not a nemo_d3s.backends.base.Policy"
        )
    return policy
