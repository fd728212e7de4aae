"""Which model framework runs the policy: a name -> (backend class, config dataclass) table,
imported lazily.

Lazy so that the HF backend's transformers import (and later Megatron's) happens only for
the backend a run uses. A Megatron backend is added by creating its package (a class
``MegatronBackend(cfg, dp_group=...)`` and its config dataclass) and filling in its entry
here; the training loop does not change.

Building: the trainer hands over the COMMON settings below (derived from the run config)
plus ``model.params`` (backend-specific). Common settings the backend's config dataclass
does not declare are dropped; a ``model.params`` key it does not declare is an error that
names the key. Values are merged into the dataclass with OmegaConf, so nested dataclasses
(e.g. the HF backend's ``tiny`` model shape) and types are checked too.

Common settings: model, dtype, device, seed, lr, weight_decay, adam_betas, grad_clip,
warmup_steps, scheduler, total_steps, use_reference, gradient_checkpointing.

A backend may also be named in the config as ``model.backend=pkg.module:Class``; such a
class declares its config dataclass as the class attribute ``config_class``.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Dict, Mapping, Tuple

from nemo_d3s.backends.base import PolicyBackend

__all__ = ["BACKENDS", "build_backend", "resolve_backend"]

# name -> ("module:BackendClass", "module:ConfigDataclass"). "megatron" is reserved.
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
        try:
            return _import(cls_path), _import(cfg_path)
        except ModuleNotFoundError as e:
            if name == "megatron" and (e.name or "").startswith("nemo_d3s.backends.megatron"):
                raise ValueError(
                    "model.backend='megatron' is reserved but not implemented yet; use model.backend=hf"
                ) from e
            raise
    if ":" not in name:
        raise ValueError(
            f"model.backend={name!r}: unknown backend; known: {', '.join(sorted(BACKENDS))}, "
            "or a 'package.module:Class' path"
        )
    cls = _import(name)
    cfg_cls = getattr(cls, "config_class", None)
    if cfg_cls is None or not dataclasses.is_dataclass(cfg_cls):
        raise ValueError(f"model.backend={name!r}: the class needs a dataclass attribute 'config_class'")
    return cls, cfg_cls


def backend_config(cfg_cls: type, common: Mapping[str, Any], params: Mapping[str, Any]) -> Any:
    """Build the backend's config dataclass from common settings + ``model.params``."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    fields = {f.name for f in dataclasses.fields(cfg_cls)}
    for key in params:
        if key not in fields:
            raise ValueError(
                f"model.params.{key}: not a setting of {cfg_cls.__name__}; known: {', '.join(sorted(fields))}"
            )
    values = {k: v for k, v in common.items() if k in fields}
    values.update(params)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(cfg_cls), OmegaConf.create(dict(values)))
    except OmegaConfBaseException as e:
        raise ValueError(f"model.params: {e}") from None
    return OmegaConf.to_object(merged)


def build_backend(name: str, common: Mapping[str, Any], params: Mapping[str, Any], dp_group: Any = None) -> PolicyBackend:
    """Construct the backend ``name``. ``dp_group``: data-parallel process group (None for
    one process); the backend SUM-reduces gradients over it because the trainer's loss is
    already divided by a global (all-ranks) denominator."""
    cls, cfg_cls = resolve_backend(name)
    backend = cls(backend_config(cfg_cls, common, params), dp_group=dp_group)
    if not isinstance(backend, PolicyBackend):
        raise TypeError(f"backend {name!r} built a {type(backend).__name__}, not a PolicyBackend")
    return backend
