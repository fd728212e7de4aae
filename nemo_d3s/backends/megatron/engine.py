"""Rollouts for a sharded policy: one engine (or a few) per model-parallel group.

An engine lives on the first rank of each block of the group (``parallel.engine_blocks``; one
block by default); the others get its rollouts by one object broadcast (several engines: one
gather) over the group's gloo twin, each engine having generated a contiguous block of the
prompts. Refits are collective (every rank runs the weight iterator, once per engine).
``ReplicaEngine`` (``backends/hf/engine.py``) runs the HF backend's seeded sampler on a
transformers copy, so Megatron and HF runs with one seed sample the same rollouts.
"""

from __future__ import annotations

import os
import socket
from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

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
from nemo_d3s.backends.engine_wait import agreed_generation
from nemo_d3s.backends.megatron.cp_rollouts import join_blocks, prompt_blocks
from nemo_d3s.backends.megatron.parallel import engine_blocks
from nemo_d3s.backends.refit import WeightRefit, release_cached_cuda_memory
from nemo_d3s.distributed.comm import is_single
from nemo_d3s.distributed.generation_wait import GenerationWait, generation_limit_s

__all__ = [
    "ModelParallelRollouts",
    "ReplicaEngine",
    "from_srcs",
    "model_parallel_group",
    "place_engine",
    "replica_engine",
]


class ModelParallelRollouts(RolloutEngine):
    """The engines of one model-parallel group: ``inner`` on the global ranks ``srcs`` (an int:
    one engine), None elsewhere.

    ``group`` is gloo, so every wait for an engine is on the host, never in an NCCL
    collective spinning on the engine's GPUs. generate: engine e generates block e of the
    prompts (``cp_rollouts.prompt_blocks``: contiguous, in order) while the other ranks wait
    on the store with a liveness check (``backends/engine_wait.py``; no collective's timeout
    caps a long generation), then one ``broadcast_object_list`` (one engine) or
    ``all_gather_object`` (several) over ``group`` gives every rank all the rollouts in prompt
    order; engines without the policy's weights version are refitted first by the whole
    group, one engine after another; a refit or generation cut by a stop signal raises
    GenerationInterrupted on every rank of the group. ``refit``: transport, bucket_bytes and
    dtype agreed by :func:`place_engine`, with ``hosts_engine_gpu`` one flag per engine (None:
    each engine's rank refits it alone).
    """

    def __init__(
        self,
        inner: Optional[RolloutEngine],
        tokenizer: Any,
        group,
        srcs: Union[int, Sequence[int]],
        *,
        prompt_seeds: bool,
        on_policy: bool = True,
        policy: Optional[Policy] = None,
        refit: Optional[dict] = None,
        device: Optional[torch.device] = None,
    ) -> None:
        self.inner, self.tokenizer, self.group = inner, tokenizer, group
        self.srcs = [int(srcs)] if isinstance(srcs, int) else [int(r) for r in srcs]
        self.own_weights = True  # a replica or vLLM on every layout
        self._should_stop = None
        self.prompt_seeds, self.on_policy = prompt_seeds, on_policy
        self.policy, self.refit, self.device = policy, refit, device
        self.wait = None  # one process per model copy (TP = PP = 1; None): nobody to wait for
        if not is_single(group):
            self.wait = GenerationWait.of_group(f"mp{self.srcs[0]}", group)

    @property
    def is_src(self) -> bool:
        """This rank holds an engine."""
        return is_single(self.group) or dist.get_rank() in self.srcs

    def _from_srcs(self, value: Any) -> List[Any]:
        """Each engine rank's ``value``, in engine order, on every rank of the group."""
        return from_srcs(self.group, self.srcs, value if self.is_src else None)

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
        blocks = prompt_blocks(len(prompts), len(self.srcs))
        mine = blocks[self.srcs.index(dist.get_rank())] if self.is_src else range(0)
        call = None
        if self.is_src and (len(mine) or len(self.srcs) == 1):

            def call() -> Rollouts:
                sub = [prompts[i] for i in mine]
                return self.inner.generate(sub, n_samples, cfg, [seeds[i] for i in mine])

        rows = max(len(b) for b in blocks) * n_samples
        limit = generation_limit_s(self.wait.base_s, rows, cfg.max_new_tokens)
        out, outcome = agreed_generation(self.wait, self.alive, call, stopping=False, limit_s=limit)
        if outcome.interrupted:  # the group's other ranks stop with the engine's
            raise GenerationInterrupted("stop requested during generation (on an engine's rank)")
        parts = self._from_srcs(out)
        if len(self.srcs) == 1:
            return parts[0]
        return join_blocks(parts, blocks, int(self.tokenizer.pad_token_id))

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
        """One refit per weights version and engine, decided by the engines' ranks for the
        whole group; with several engines, one after another (each a full pass of the
        collective weight iterator)."""
        if is_single(self.group):
            self.inner.sync_weights(policy)
            return
        me = dist.get_rank()
        if self.refit is None:
            for src in self.srcs:
                if me == src:
                    self.inner.sync_weights(policy)
                else:  # serve the gathers; the tensors are not needed here
                    for _ in policy.refit_weights():
                        pass
            return
        needs = self._from_srcs(self.is_src and self.inner.needs_refit(policy))
        r = self.refit
        for src, need, hosts in zip(self.srcs, needs, r["hosts_engine_gpu"]):
            if not need:
                continue
            refit = WeightRefit(
                self.inner if me == src else None,
                transport=r["transport"],
                group=self.group,
                src=src,
                hosts_engine_gpu=hosts,
                bucket_bytes=r["bucket_bytes"],
                dtype=getattr(torch, r["dtype"]),
                device=self.device,
            )
            if me == src:
                self.inner.run_refit(refit, policy.refit_weights(), policy.weights_version)
            else:
                refit.push(policy.refit_weights())


def from_srcs(group: Any, srcs: Sequence[int], value: Any) -> List[Any]:
    """The ``value`` of each global rank in ``srcs``, in that order, on every rank of
    ``group``: one ``broadcast_object_list`` from a single rank, else one
    ``all_gather_object`` (the other ranks send what they pass, None)."""
    if len(srcs) == 1:
        box: List[Any] = [value]
        dist.broadcast_object_list(box, src=srcs[0], group=group)
        return box
    everyone: List[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, value, group=group)
    return [everyone[dist.get_group_rank(group, r)] for r in srcs]


def make_replica(
    path: str,
    tokenizer: Any,
    *,
    dtype: torch.dtype,
    device: torch.device,
    cfg: Any,
    eos_ids: List[int],
) -> SamplerModel:
    """A transformers model of ``path`` (local files, dropout off, eval) for a replica."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from nemo_d3s.backends.hf.loading import folder_generation_config, zero_dropout_config

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    zero_dropout_config(config)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.generation_config = folder_generation_config(path)  # as from_pretrained sets it
    model.to(device).eval()
    model.requires_grad_(False)
    return SamplerModel(
        model,
        tokenizer,
        cfg,
        int(tokenizer.pad_token_id),
        list(eos_ids),
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
    policy: Any,
    build: Callable[[], RolloutEngine],
    gloo_group: Callable[[], Any],
    engines: int = 1,
) -> ModelParallelRollouts:
    """``build()`` on the first rank of each of the model-parallel group's ``engines`` blocks
    (``parallel.engine_blocks``), which tell the group how refits travel and where each engine
    runs; a failed start raises on every rank."""
    mp, first = model_parallel_group()
    group = gloo_group() if mp is not None else None
    if group is None and int(engines) != 1:
        raise ValueError(f"{engines} engines per model copy: this copy is one rank")
    srcs = [first]
    if int(engines) > 1:
        srcs = [b[0] for b in engine_blocks(dist.get_process_group_ranks(group), engines)]
    inner, failure = None, None
    if group is None or dist.get_rank() in srcs:
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
    mine: Any = (inner.prompt_seeds, inner.on_policy, refit) if inner is not None else None
    if failure is not None:
        mine = f"{type(failure).__name__}: {failure}"
    flags = [mine] if group is None else from_srcs(group, srcs, mine)
    if failure is not None:
        raise failure
    for src, f in zip(srcs, flags):
        if isinstance(f, str):
            raise RuntimeError(f"the rollout engine failed to start on rank {src}: {f}")
    prompt_seeds, on_policy, refit = flags[0]
    if refit is not None:
        refit = {k: refit[k] for k in ("transport", "bucket_bytes", "dtype")}
        refit["hosts_engine_gpu"] = [
            _hosts_engine_gpu(policy, s, f[2]) for s, f in zip(srcs, flags)
        ]
    return ModelParallelRollouts(
        inner,
        policy.tokenizer,
        group,
        srcs,
        prompt_seeds=prompt_seeds,
        on_policy=on_policy,
        policy=policy,
        refit=refit,
        device=policy.device,
    )


def _hosts_engine_gpu(policy: Any, src: int, refit: dict) -> bool:
    """Whether this rank stages refits for a worker of the engine on rank ``src`` (``refit``:
    that engine's transport, host, GPUs and worker count)."""
    if refit["host"] != socket.gethostname():
        return False
    if refit["transport"] == "shm":  # the CPU twin: rank src + i stages for worker i
        return 0 <= dist.get_rank() - src < int(refit["workers"])
    return policy.device.type == "cuda" and own_gpu_entry() in refit["gpus"]


def replica_engine(policy: Any) -> Callable[[], ReplicaEngine]:
    """Builder of a :class:`ReplicaEngine` for ``policy``, ending responses at its EOS ids."""

    def build() -> ReplicaEngine:
        replica = make_replica(
            policy.path,
            policy.tokenizer,
            dtype=policy.dtype,
            device=policy.device,
            cfg=policy.cfg,
            eos_ids=policy.eos_ids,
        )
        return ReplicaEngine(replica)

    return build
