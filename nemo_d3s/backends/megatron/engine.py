"""Rollouts for a sharded policy: one engine per model-parallel group.

The engine lives on the group's first rank; the others get its rollouts by one object
broadcast over the group's gloo twin. Refits are collective (every rank runs the weight
iterator). ``ReplicaEngine`` (``backends/hf/engine.py``) runs the HF backend's seeded sampler on
a transformers copy, so Megatron and HF runs with one seed sample the same rollouts.
"""

from __future__ import annotations

import os
import socket
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from nemo_d3s.backends.base import (
    GenerationConfig,
    GenerationInterrupted,
    Policy,
    RolloutEngine,
    Rollouts,
)
from nemo_d3s.backends.hf.engine import ReplicaEngine, SamplerModel
from nemo_d3s.backends.hf.rollout import stop_token_ids
from nemo_d3s.backends.engine_wait import agreed_generation
from nemo_d3s.backends.refit import WeightRefit, release_cached_cuda_memory
from nemo_d3s.distributed.comm import is_single
from nemo_d3s.distributed.generation_wait import GenerationWait, generation_limit_s

__all__ = [
    "ModelParallelRollouts",
    "ReplicaEngine",
    "model_parallel_group",
    "place_engine",
    "replica_engine",
]


class ModelParallelRollouts(RolloutEngine):
    """One engine per model-parallel group: ``inner`` on global rank ``src``, None elsewhere.

    ``group`` is gloo, so every wait for the engine is on the host, never in an NCCL
    collective spinning on the engine's GPUs. generate: ranks other than ``src`` wait for it on
    the store with a liveness check (``backends/engine_wait.py``; no collective's timeout caps
    a long generation), then one ``broadcast_object_list`` of the Rollouts over ``group``; an
    engine without the policy's weights version is refitted first by the whole group; a refit
    or generation cut by a stop signal raises GenerationInterrupted on every rank of the group.
    ``refit``: transport, bucket_bytes, dtype and hosts_engine_gpu agreed by
    :func:`place_engine` (None: ``src`` refits its engine alone).
    """

    def __init__(
        self,
        inner: Optional[RolloutEngine],
        tokenizer: Any,
        group,
        src: int,
        *,
        prompt_seeds: bool,
        on_policy: bool = True,
        policy: Optional[Policy] = None,
        refit: Optional[dict] = None,
        device: Optional[torch.device] = None,
    ) -> None:
        self.inner, self.tokenizer, self.group, self.src = inner, tokenizer, group, src
        self.own_weights = True  # a replica or vLLM on every layout
        self._should_stop = None
        self.prompt_seeds, self.on_policy = prompt_seeds, on_policy
        self.policy, self.refit, self.device = policy, refit, device
        self.wait = None  # one process per model copy (TP = PP = 1; None): nobody to wait for
        if not is_single(group):
            self.wait = GenerationWait.of_group(f"mp{src}", group)

    @property
    def is_src(self) -> bool:
        return is_single(self.group) or dist.get_rank() == self.src

    def _from_src(self, value: Any) -> Any:
        box: List[Any] = [value if self.is_src else None]
        dist.broadcast_object_list(box, src=self.src, group=self.group)
        return box[0]

    def generate(
        self, prompts: List[str], n_samples: int, cfg: GenerationConfig, seeds: Sequence[int]
    ) -> Rollouts:
        if is_single(self.group):
            return self.inner.generate(prompts, n_samples, cfg, seeds)
        if self.refit_on_generate:
            if self.refit is not None:
                try:  # a refit only when the engine holds another version
                    self.sync_weights(self.policy)
                except Exception as e:
                    if self.stopped or (self.should_stop is not None and self.should_stop()):
                        raise GenerationInterrupted(f"the refit stopped with the job: {e}") from e
                    raise
            release_cached_cuda_memory(self.device)  # this rank's GPU may carry an engine worker
        dist.barrier(group=self.group)
        call = (
            (lambda: self.inner.generate(prompts, n_samples, cfg, seeds)) if self.is_src else None
        )
        limit = generation_limit_s(self.wait.base_s, len(prompts) * n_samples, cfg.max_new_tokens)
        out, outcome = agreed_generation(self.wait, self.alive, call, stopping=False, limit_s=limit)
        if outcome.interrupted:  # the group's other ranks stop with the engine's
            raise GenerationInterrupted("stop requested during generation (on the engine's rank)")
        return self._from_src(out)

    @property
    def should_stop(self):
        return self.inner.should_stop if self.inner is not None else self._should_stop

    @should_stop.setter
    def should_stop(self, fn) -> None:
        self._should_stop = fn
        if self.inner is not None:
            self.inner.should_stop = fn

    def release(self) -> None:
        if self.inner is not None:
            self.inner.release()

    def pin_weights(self) -> None:
        self.refit_on_generate = False
        if self.inner is not None:
            self.inner.pin_weights()

    def held_weights(self):
        return self.inner.held_weights() if self.inner is not None else iter(())

    def alive(self) -> bool:
        return self.inner is None or self.inner.alive()

    @property
    def stopped(self) -> bool:
        return self.inner is not None and self.inner.stopped

    def sync_weights(self, policy: Policy) -> None:
        """One refit per weights version, decided by the engine's rank for the whole group."""
        if self.refit is None or is_single(self.group):
            if self.is_src:
                self.inner.sync_weights(policy)
            else:
                for (
                    _
                ) in policy.refit_weights():  # serve the gathers; the tensors are not needed here
                    pass
            return
        if not self._from_src(self.is_src and self.inner.needs_refit(policy)):
            return
        r = self.refit
        refit = WeightRefit(
            self.inner if self.is_src else None,
            transport=r["transport"],
            group=self.group,
            src=self.src,
            hosts_engine_gpu=r["hosts_engine_gpu"],
            bucket_bytes=r["bucket_bytes"],
            dtype=getattr(torch, r["dtype"]),
            device=self.device,
        )
        if self.is_src:
            self.inner.run_refit(refit, policy.refit_weights(), policy.weights_version)
        else:
            refit.push(policy.refit_weights())


def make_replica(
    path: str,
    tokenizer: Any,
    *,
    dtype: torch.dtype,
    device: torch.device,
    cfg: Any,
    eos_ids_fn: Callable[[Any], List[int]],
) -> SamplerModel:
    """A transformers model of ``path`` (local files, dropout off, eval) for a replica."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from nemo_d3s.backends.hf.loading import zero_dropout_config

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    zero_dropout_config(config)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    try:  # EOS ids as the HF backend sees them (generation_config.json may list several)
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(path, local_files_only=True)
    except OSError:
        pass  # no generation_config.json: the one derived from config.json stands
    model.to(device).eval()
    model.requires_grad_(False)
    return SamplerModel(
        model,
        tokenizer,
        cfg,
        int(tokenizer.pad_token_id),
        eos_ids_fn(model),
        device,
        bool(cfg.use_chat_template),
    )


def own_gpu_entry() -> Optional[str]:
    """This rank's GPU as an entry of the node's visible devices; None without CUDA."""
    if not torch.cuda.is_available():
        return None
    from nemo_d3s.backends.vllm.placement import local_gpus

    return local_gpus(os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.device_count())[
        torch.cuda.current_device()
    ]


def model_parallel_group() -> Tuple[Any, int]:
    """(Megatron's model-parallel group or None for one rank, its first rank's global rank)."""
    from megatron.core import parallel_state as ps

    mp = ps.get_model_parallel_group()
    return (None if dist.get_world_size(mp) == 1 else mp), dist.get_global_rank(mp, 0)


def place_engine(
    policy: Any, build: Callable[[], RolloutEngine], gloo_group: Callable[[], Any]
) -> ModelParallelRollouts:
    """``build()`` on the first rank of each model-parallel group, which tells the group how
    refits travel and where the engine runs; a failed start raises on every rank."""
    mp, src = model_parallel_group()
    inner, failure = None, None
    if dist.get_rank() == src:
        try:
            inner = build()
        except Exception as e:
            failure = e
    refit = None
    if inner is not None and getattr(inner, "transport", None) is not None:
        refit = {
            "transport": inner.transport,
            "bucket_bytes": int(inner.bucket_bytes),
            "dtype": str(inner.weights_dtype).removeprefix("torch."),
            "host": socket.gethostname(),
            "gpus": (inner.visible_devices or "").split(","),
            "workers": int(inner.cfg.tensor_parallel_size),
        }
    flags: List[Any] = [(inner.prompt_seeds, inner.on_policy, refit) if inner is not None else None]
    if failure is not None:
        flags = [f"{type(failure).__name__}: {failure}"]
    group = gloo_group() if mp is not None else None
    if group is not None:
        dist.broadcast_object_list(flags, src=src, group=group)
    if failure is not None:
        raise failure
    if isinstance(flags[0], str):
        raise RuntimeError(f"the rollout engine failed to start on rank {src}: {flags[0]}")
    prompt_seeds, on_policy, refit = flags[0]
    if refit is not None:
        same_host = refit.pop("host") == socket.gethostname()
        gpus, workers = refit.pop("gpus"), refit.pop("workers")
        if refit["transport"] == "shm":  # the CPU twin: rank src + i stages for worker i
            refit["hosts_engine_gpu"] = same_host and 0 <= dist.get_rank() - src < workers
        else:
            refit["hosts_engine_gpu"] = (
                policy.device.type == "cuda" and same_host and own_gpu_entry() in gpus
            )
    return ModelParallelRollouts(
        inner,
        policy.tokenizer,
        group,
        src,
        prompt_seeds=prompt_seeds,
        on_policy=on_policy,
        policy=policy,
        refit=refit,
        device=policy.device,
    )


def replica_engine(policy: Any) -> Callable[[], ReplicaEngine]:
    """Builder of a :class:`ReplicaEngine` for ``policy``; its EOS ids become the policy's."""

    def build() -> ReplicaEngine:
        replica = make_replica(
            policy.path,
            policy.tokenizer,
            dtype=policy.dtype,
            device=policy.device,
            cfg=policy.cfg,
            eos_ids_fn=lambda m: stop_token_ids(
                policy.tokenizer, m.generation_config, policy.cfg.stop_tokens
            ),
        )
        policy.eos_ids = replica.eos_ids
        return ReplicaEngine(replica)

    return build
