"""Config -> objects: the policy (which builds the parallel layout), its rollout engine, the
selector, the loss and generation configs; apart from the loop so a notebook can build them.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any, Dict, Tuple

import torch

from nemo_d3s.backends.base import GenerationConfig, Policy, RolloutEngine
from nemo_d3s.backends.engines import build_rollout_engine
from nemo_d3s.backends.wrappers import OneSeedPerCall, PerPromptCalls
from nemo_d3s.config import AlgorithmConfig, D3SSection
from nemo_d3s.errors import ConfigError
from nemo_d3s.core.d3s import D3SConfig
from nemo_d3s.core.losses import LossConfig
from nemo_d3s.distributed.groups import ParallelGroups
from nemo_d3s.distributed.selector import DistributedD3SSelector
from nemo_d3s.trainer.backend_registry import build_backend, checked_config
from nemo_d3s.versions import check_stack

__all__ = [
    "check_runtime",
    "plain",
    "d3s_config",
    "build_selector",
    "loss_config",
    "generation_config",
    "backend_settings",
    "checked_backend_config",
    "backend_from_config",
    "rollout_engine",
]


def plain(x: Any) -> Any:
    """A resolved plain-Python copy of an OmegaConf node (anything else unchanged)."""
    from omegaconf import OmegaConf  # a core dependency: a failing import is a real error

    if OmegaConf.is_config(x):
        return OmegaConf.to_container(x, resolve=True)
    return x


def d3s_config(cfg: Any) -> D3SConfig:
    """The core D3SConfig of ``cfg.d3s`` (+ ``cfg.algorithm.advantage``, ``cfg.seed``),
    through the schema's section (:meth:`nemo_d3s.config.D3SSection.to_core`)."""
    section = D3SSection(**plain(cfg.d3s))
    try:
        return section.to_core(advantage=cfg.algorithm.advantage, seed=int(cfg.seed))
    except ValueError as e:
        raise ConfigError(f"d3s: {e}") from None


def build_selector(cfg: Any, groups: ParallelGroups) -> DistributedD3SSelector:
    """The DP-global selector over ``groups.dp``: selection and the token top-K threshold span all
    ranks, so a 2-rank run selects what a 1-rank run does on the same global batch.
    """
    return DistributedD3SSelector(
        d3s_config(cfg), groups.dp, batch_scope=cfg.d3s.dp_batch_scope, device=groups.device
    )


def loss_config(cfg: Any) -> LossConfig:
    """The core LossConfig of ``cfg.algorithm``, through the schema's section
    (:meth:`nemo_d3s.config.AlgorithmConfig.loss_config`)."""
    a = cfg.algorithm
    section = a if isinstance(a, AlgorithmConfig) else AlgorithmConfig(**plain(a))
    # The trainer checks the step's tensors once (trainer.step) instead of in every
    # micro-batch, where each check would wait for the device.
    return section.loss_config(check_inputs=False)


def generation_config(cfg: Any) -> GenerationConfig:
    """The rollout engines' sampling settings from ``trainer.*``."""
    t = cfg.trainer
    return GenerationConfig(
        max_new_tokens=int(t.max_new_tokens),
        temperature=float(t.temperature),
        top_p=float(t.top_p),
        top_k=int(t.top_k),
        do_sample=True,
    )


def check_runtime(cfg: Any) -> None:
    """What this machine must provide (after ``config.validate``, before any model loads): software
    inside the tested ranges (``nemo_d3s.versions``, or NEMO_D3S_ALLOW_UNTESTED=1), vLLM for
    ``rollout.engine=vllm``, a CUDA torch that sees a GPU for ``model.device=cuda``. Kept out of
    ``config.validate`` because the dry run plans GPU jobs on machines without them.
    """
    engine = cfg.rollout.engine
    uses = ["torch"]
    if str(cfg.model.backend) == "megatron":
        uses += ["megatron-core", "transformer-engine"]
    if engine == "vllm":
        uses.append("vllm")
    check_stack(uses)
    if int(cfg.rollout.generation_gpus):
        raise ConfigError(
            f"rollout.generation_gpus={cfg.rollout.generation_gpus}: engines on GPUs apart from "
            "the training GPUs are planned by the dry run (trainer.dry_run=true) only; the "
            "trainer starts each engine on its own ranks' GPUs (rollout.generation_gpus=0)"
        )
    replay = str(getattr(cfg.algorithm, "router_replay", "none"))
    if replay != "none" and engine not in ("hf", "vllm"):
        raise ConfigError(
            f"algorithm.router_replay={replay!r} replays the routing an engine returns: the "
            f"seeded sampler's (rollout=hf) or vLLM's on a GPU, not rollout.engine={engine!r}'s"
        )
    if engine == "vllm":
        _check_vllm_routing(cfg.rollout.routed_experts, replay)
        if cfg.rollout.expert_parallel and not torch.cuda.is_available():
            from nemo_d3s.backends.vllm.expert_parallel import CPU_BUILD_NO_EP

            raise ConfigError(f"rollout.expert_parallel=true needs a GPU: {CPU_BUILD_NO_EP}")
    if engine == "vllm" and importlib.util.find_spec("vllm") is None:
        from nemo_d3s.backends.vllm.engine import VLLM_INSTALL_HINT

        raise ConfigError(
            f"rollout.engine={engine!r}: vLLM is not installed in this Python; "
            f"{VLLM_INSTALL_HINT}; or use rollout=hf"
        )
    device = str(cfg.model.device)
    if device.startswith("cuda"):
        if torch.version.cuda is None:
            raise ConfigError(
                f"model.device={device!r}: this torch {torch.__version__} is a CPU-only "
                "build; install a CUDA build of torch, or use model.device=cpu"
            )
        if not torch.cuda.is_available():
            raise ConfigError(
                f"model.device={device!r}: torch sees no GPU here (CUDA_VISIBLE_DEVICES="
                f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}); "
                "run on a GPU node, or use model.device=cpu"
            )


def _check_vllm_routing(setting: Any, replay: str) -> None:
    """``rollout.routed_experts`` and router replay with vLLM: its routing comes from a GPU only
    (``backends/vllm/routing.py``)."""
    from nemo_d3s.backends.vllm.routing import CPU_BUILD_REFUSES

    if replay != "none" and setting is False:
        raise ConfigError(
            f"algorithm.router_replay={replay!r} with rollout.routed_experts=false: the engine "
            "would return no routing to replay"
        )
    wants = "rollout.routed_experts=true" if setting is True else None
    if replay != "none":
        wants = f"algorithm.router_replay={replay!r} with rollout=vllm"
    if wants and not torch.cuda.is_available():
        raise ConfigError(
            f"{wants} needs a GPU: {CPU_BUILD_REFUSES} (rollout=hf records the routing on the CPU)"
        )


def backend_settings(cfg: Any) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """(common settings, ``model.params``): the run config in the terms a backend's config
    dataclass takes (``trainer.backend_registry``)."""
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
        "dist_timeout_minutes": _optional_float(getattr(t, "dist_timeout_minutes", None)),
        "pack_sequences": getattr(t, "pack_sequences", None),
        "logit_temperature": float(t.temperature),
    }
    return common, plain(cfg.model.params) or {}


def checked_backend_config(cfg: Any) -> Any:
    """The typed, checked config of ``model.backend`` without building anything (the dry run plans
    with it).
    """
    try:
        return checked_config(str(cfg.model.backend), *backend_settings(cfg))[1]
    except ValueError as e:  # unknown backend / model.params key / bad backend option
        raise ConfigError(f"model: {e}") from None


def backend_from_config(cfg: Any) -> Policy:
    """The policy named by ``model.backend``; it builds the parallel layout (``policy.groups``).
    Common settings come from the run config, backend-specific ones from ``model.params``."""
    try:
        return build_backend(cfg.model.backend, *backend_settings(cfg))
    except ValueError as e:  # unknown backend / model.params key / bad backend option
        raise ConfigError(f"model: {e}") from None


def _optional_float(v: Any):
    return None if v is None else float(v)


def engine_settings(cfg: Any) -> dict:
    """``rollout``'s settings with ``log_file`` resolved: null -> ``vllm_engine.log`` in the run
    directory (``vllm_engine_rank<R>.log`` on a rank R > 0: one engine per model-parallel
    group), "-" -> None (the terminal)."""
    import torch.distributed as dist

    settings = plain(cfg.rollout)
    log_file = settings.get("log_file")
    if log_file is None:
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        name = "vllm_engine.log" if rank == 0 else f"vllm_engine_rank{rank}.log"
        settings["log_file"] = str(Path(str(cfg.output_dir)) / name)
    elif log_file == "-":
        settings["log_file"] = None
    return settings


def rollout_engine(policy: Policy, cfg: Any) -> RolloutEngine:
    """The engine ``rollout.engine`` names (hf: the policy's own; with ``rollout.max_staleness``
    > 0 one with its own weights copy, ``Policy.weights_copy_engine``), wrapped per
    ``trainer.generate_per_prompt`` when it cannot take one seed per prompt (``backends.wrappers``).
    """
    engine = build_rollout_engine(str(cfg.rollout.engine), policy, engine_settings(cfg))
    if str(cfg.rollout.engine) == "vllm":
        from nemo_d3s.backends.vllm.routing import returns_routing

        # every rank, an engine's or not, decides alike: the same settings, the same devices
        # (a dense model records nothing whatever this says: MegatronBackend.records_routing)
        policy.engine_returns_routing(
            returns_routing(cfg.rollout.routed_experts, True, torch.cuda.is_available())
        )
    if int(cfg.rollout.max_staleness) > 0 and not engine.own_weights:
        engine = policy.weights_copy_engine()
    if engine.prompt_seeds:
        return engine
    return (
        PerPromptCalls(engine) if bool(cfg.trainer.generate_per_prompt) else OneSeedPerCall(engine)
    )
