"""Config -> objects: the selector, the loss config, the backend, the generation config.

Kept apart from the loop so a notebook can build the same pieces (``build_selector(cfg)``)
without running anything. ``cfg`` is a resolved :class:`nemo_d3s.config.TrainConfig`
(DictConfig or dataclass).
"""

from __future__ import annotations

from typing import Any, Dict

from nemo_d3s.backends.base import GenerationConfig, PolicyBackend
from nemo_d3s.config import ConfigError
from nemo_d3s.core.d3s import D3SConfig, D3SSelector
from nemo_d3s.core.losses import LossConfig
from nemo_d3s.core.schedules import DynamicSchedule
from nemo_d3s.trainer.backend_registry import build_backend
from nemo_d3s.trainer.dist import DPInfo

__all__ = ["plain", "d3s_config", "build_selector", "loss_config", "generation_config", "backend_from_config"]


def plain(x: Any) -> Any:
    """A resolved plain-Python copy of an OmegaConf node (anything else unchanged)."""
    try:
        from omegaconf import OmegaConf

        if OmegaConf.is_config(x):
            return OmegaConf.to_container(x, resolve=True)
    except ImportError:
        pass
    return x


def d3s_config(cfg: Any) -> D3SConfig:
    """The core D3SConfig of ``cfg.d3s`` (+ ``cfg.algorithm.advantage``, ``cfg.seed``)."""
    s = cfg.d3s.schedule
    kwargs: Dict[str, Any] = {}
    if s.kind == "step" and len(s.milestones):
        kwargs["milestones"] = [float(m) for m in s.milestones]
    try:
        schedule = DynamicSchedule(s.kind, s.n_init, s.n_final, float(s.k_init), float(s.k_final), kwargs)
    except ValueError as e:
        raise ConfigError(f"d3s.schedule: {e}") from None
    return D3SConfig(
        advantage=cfg.algorithm.advantage,
        sample_rule=cfg.d3s.sample_rule,
        token_scope=cfg.d3s.token_scope,
        schedule=schedule,
        eps=float(cfg.d3s.eps),
        unbiased=bool(cfg.d3s.unbiased),
        seed=int(cfg.seed),
    )


def needs_global_selection(d3s: D3SConfig) -> bool:
    """Whether the selection of one rank depends on the other ranks' rollouts: the pooled
    cross-group rule, the token top-K over the whole batch, and "random" (its draws depend
    on positions in the global batch). Per-group and per-row rules are exact locally."""
    return d3s.sample_rule in ("d3s_cross", "random") or d3s.token_scope == "batch"


def build_selector(cfg: Any, dp: DPInfo) -> Any:
    """D3SSelector for one process; under torchrun the DP-global DistributedD3SSelector, so
    cross-group selection and the token top-K threshold span all ranks (a 2-rank run then
    selects what a 1-rank run selects on the same global batch)."""
    d3s = d3s_config(cfg)
    if not dp.distributed:
        return D3SSelector(d3s)
    try:
        from nemo_d3s.distributed.selector import DistributedD3SSelector
    except ImportError:
        if needs_global_selection(d3s):
            raise ConfigError(
                f"d3s.sample_rule={d3s.sample_rule!r} / d3s.token_scope={d3s.token_scope!r} need the "
                "DP-global selector (nemo_d3s.distributed.DistributedD3SSelector), which is not available"
            ) from None
        return D3SSelector(d3s)  # per-group / per-row rules: the local result is the global one
    return DistributedD3SSelector(d3s, dp.group, batch_scope=cfg.d3s.dp_batch_scope)


def loss_config(cfg: Any) -> LossConfig:
    a = cfg.algorithm
    return LossConfig(
        clip_eps_low=float(a.clip_eps_low),
        clip_eps_high=float(a.clip_eps_high),
        dual_clip_c=None if a.dual_clip_c is None else float(a.dual_clip_c),
        kl_coef=float(a.kl_coef),
        aggregation=a.aggregation,
    )


def generation_config(cfg: Any) -> GenerationConfig:
    t = cfg.trainer
    return GenerationConfig(
        max_new_tokens=int(t.max_new_tokens), temperature=float(t.temperature), top_p=float(t.top_p),
        top_k=int(t.top_k), do_sample=True,
    )


def backend_from_config(cfg: Any, dp: DPInfo) -> PolicyBackend:
    """The policy backend named by ``model.backend``; common settings come from the run
    config, backend-specific ones from ``model.params``."""
    t = cfg.trainer
    common = {
        "model": cfg.model.name,
        "dtype": cfg.model.dtype,
        "device": cfg.model.device,
        "seed": int(cfg.seed),
        "lr": float(t.lr),
        "weight_decay": float(t.weight_decay),
        "adam_betas": [float(t.adam_beta1), float(t.adam_beta2)],
        "grad_clip": float(t.grad_clip) if t.grad_clip is not None else 0.0,
        "warmup_steps": int(t.warmup_steps),
        "scheduler": t.lr_schedule,
        "total_steps": int(t.steps) * int(t.num_mini_batches),
        "use_reference": float(cfg.algorithm.kl_coef) > 0,
        "gradient_checkpointing": bool(cfg.model.gradient_checkpointing),
    }
    try:
        return build_backend(cfg.model.backend, common, plain(cfg.model.params) or {}, dp.group)
    except ValueError as e:  # unknown backend / model.params key / bad backend option
        raise ConfigError(f"model: {e}") from None
