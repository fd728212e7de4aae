"""``MegatronBackend``: the policy as a megatron-core ``GPTModel`` sharded over TP x PP x DP.

Loads an HF, converted, NeMo 2 or Megatron-LM checkpoint through the weight table; steps run
through ``schedule.py``, rollouts through one engine per model-parallel group, checkpoints
are reshardable safetensors. Every check that can fail on bad input runs before the first
collective, so all ranks raise the same error rather than some hanging.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from nemo_d3s.backends.base import LossFn, Policy, RolloutEngine, Scores, TokenBatch
from nemo_d3s.backends.hf.loading import folder_generation_config, load_tokenizer
from nemo_d3s.backends.hf.rollout import encode_prompts, stop_token_ids
from nemo_d3s.backends.megatron import checkpoint as ckpt
from nemo_d3s.backends.megatron import schedule
from nemo_d3s.backends.megatron.build import build_policy
from nemo_d3s.backends.megatron.config import MegatronBackendConfig, check_options
from nemo_d3s.backends.megatron.engine import model_parallel_group, place_engine, replica_engine
from nemo_d3s.backends.megatron.model import iter_hf_weights
from nemo_d3s.backends.megatron.moe import router_loss_metrics
from nemo_d3s.backends.megatron.parallel import engine_ranks_of_model_copies, rank_order
from nemo_d3s.backends.wrappers import pad_token_id
from nemo_d3s.distributed.groups import ParallelGroups
from nemo_d3s.files import atomic_folder
from nemo_d3s.formats.safetensors_stream import write_hf_weights
from nemo_d3s.formats.weights import hf_names, hf_shape

__all__ = ["MegatronBackend"]


class MegatronBackend(Policy):
    """Policy on megatron-core's GPTModel; builds its groups (an existing Megatron layout of
    the same TP/PP is reused)."""

    collective_export = True
    # The options this backend refuses, checked before anything is built; build_backend and
    # the dry run call it through the backend registry.
    check_config = staticmethod(check_options)

    def __init__(self, cfg: MegatronBackendConfig, groups: Optional[ParallelGroups] = None) -> None:
        check_options(cfg)
        from nemo_d3s.backends.megatron.parallel import set_cuda_connections

        set_cuda_connections()  # before CUDA initialises (init_world's torch.cuda.set_device)
        self.cfg = cfg
        # device, dtype, te, pack, path, spec, vpp, groups, layout, stage_layouts, model,
        # ref_model, chunks, optimizer, router_taps, scheduler: build.PolicyParts says each
        parts = build_policy(cfg, groups, owner=self)
        self.__dict__.update(vars(parts))

        self.tokenizer = load_tokenizer(self.path)
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token  # padding is always masked out
        self.use_chat_template = cfg.use_chat_template
        # as the HF backend's: the tokenizer's EOS, the generation config's and stop_tokens;
        # every engine (the replica, vLLM) stops at these
        self.eos_ids = stop_token_ids(
            self.tokenizer, folder_generation_config(self.path), cfg.stop_tokens
        )
        self._own_engine: Optional[RolloutEngine] = None
        # whether an engine apart from this backend returns each token's experts
        # (engine_returns_routing): the scores then record the policy's own to compare
        self.engine_routing = False

    @property
    def rollout_engine(self) -> RolloutEngine:
        """The seeded HF sampler on a transformers replica, built on first use (collective),
        so a vLLM run never holds the replica; at CP > 1 the copy's CP ranks share the prompts
        (``cp_rollouts.py``)."""
        if self._own_engine is None:
            self._own_engine = self.place_rollout_engine(replica_engine(self))
            self._own_engine.sync_weights(self)  # the replica starts from these weights
        return self._own_engine

    @property
    def weights_dtype(self) -> torch.dtype:
        return self.dtype

    def rollout_engine_ranks(self, world_size: int) -> List[int]:
        """The first rank of each TP x PP group's engine blocks (``place_rollout_engine``
        builds there; one block per group unless ``rollout_engines_per_copy``)."""
        tp, pp, cp = self.layout.tp, self.layout.pp, self.groups.cp_size
        order = rank_order(bool(self.cfg.use_tp_pp_dp_mapping))
        dp = int(world_size) // (tp * pp * cp)
        return engine_ranks_of_model_copies(
            tp, pp, dp, order, cp, int(self.cfg.rollout_engines_per_copy)
        )

    def refit_weights(self) -> Iterator[Tuple[str, torch.Tensor]]:
        """``hf_weights`` left on the GPU (no host copy on any rank; ``backends.refit``)."""
        return iter_hf_weights(
            self.model, self.spec, self.layout, self.groups, to_cpu=False, vpp=self.vpp
        )

    def place_rollout_engine(self, build) -> RolloutEngine:
        """``rollout_engines_per_copy`` engines per model-parallel group (``engine.place_engine``);
        under context parallelism the CP ranks' groups of a copy each generate a block of its
        prompts and gather them (``cp_rollouts.ContextParallelRollouts``)."""
        engines = int(self.cfg.rollout_engines_per_copy)
        engine = place_engine(self, build, self.mp_gloo_group, engines)
        if self.groups.cp_size > 1:
            from nemo_d3s.backends.megatron.cp_rollouts import ContextParallelRollouts
            from nemo_d3s.backends.megatron.parallel import context_parallel_gloo_group

            group = context_parallel_gloo_group()
            if group is None:
                raise RuntimeError(
                    "no gloo twin of the context-parallel group: build Megatron's groups with "
                    "parallel.initialize_megatron_groups (or make_model_parallel_gloo_twin)"
                )
            engine = ContextParallelRollouts(engine, group, pad_token_id(self.tokenizer))
        return engine

    mp_group = staticmethod(model_parallel_group)

    def mp_gloo_group(self):
        """The gloo twin of this rank's model-parallel group (Megatron's is NCCL on CUDA)."""
        from nemo_d3s.backends.megatron.parallel import model_parallel_gloo_group

        group = model_parallel_gloo_group()
        if group is None:
            raise RuntimeError(
                "no gloo twin of the model-parallel group: build Megatron's groups with "
                "parallel.initialize_megatron_groups (or make_model_parallel_gloo_twin)"
            )
        return group

    # ------------------------------------------------------------------ Policy
    def score(
        self,
        batch: TokenBatch,
        *,
        with_entropy: bool,
        reference: bool = False,
        micro_batch_size: int = 8,
        micro_batch_tokens: int = 0,
    ) -> Scores:
        if reference and self.ref_model is None:
            raise ValueError("reference=True but the backend was built with use_reference=False")
        if reference and batch.routed_experts is not None:
            raise ValueError("router replay: the reference model routes by itself")
        model = self.ref_model if reference else self.model
        return schedule.score(
            model,
            batch,
            self.groups,
            micro_batch_size=micro_batch_size,
            with_entropy=with_entropy and not reference,
            vocab_size=self.spec.vocab_size,
            chunk_size=self.cfg.entropy_chunk_size,
            micro_batch_tokens=micro_batch_tokens,
            pack=self.pack,
            width_quantum=self.cfg.width_quantum,
            taps=None if reference else self.router_taps,
            record_routing=not reference and self.records_routing,
            temperature=self.cfg.logit_temperature,
        )

    def engine_returns_routing(self, returns: bool) -> None:
        self.engine_routing = bool(returns)

    @property
    def records_routing(self) -> bool:
        """Whether the policy's scores carry its own routing (``Scores.routed_experts``, for
        ``rollout_routing_mismatch``): ``moe_record_routing``, or (None) when an engine that
        returns a routing to compare generates: this backend's own seeded sampler, or one the
        trainer marked so (:meth:`engine_returns_routing`: vLLM with ``rollout.routed_experts``)."""
        if not self.spec.num_experts:
            return False
        if self.cfg.moe_record_routing is None:
            return self._own_engine is not None or self.engine_routing
        return bool(self.cfg.moe_record_routing)

    def train_step(
        self,
        batch: TokenBatch,
        loss_fn: LossFn,
        micro_batch_size: int,
        *,
        denominator: float,
        micro_batch_tokens: int = 0,
    ) -> Dict[str, float]:
        metrics = schedule.train_step(
            self.chunks,
            self.optimizer,
            batch,
            loss_fn,
            self.groups,
            micro_batch_size=micro_batch_size,
            denominator=denominator,
            grad_clip=self.cfg.grad_clip,
            vocab_size=self.spec.vocab_size,
            lr_scheduler=self.scheduler,
            chunk_size=self.cfg.entropy_chunk_size,
            micro_batch_tokens=micro_batch_tokens,
            pack=self.pack,
            width_quantum=self.cfg.width_quantum,
            taps=self.router_taps,
            temperature=self.cfg.logit_temperature,
        )
        if self.spec.num_experts:  # the step's micro-batches with router losses, over DP
            n = self.router_taps.loss_micro_batches
            metrics.update(router_loss_metrics(self.groups, self.spec.num_layers, n))
        if not metrics.get("skipped"):
            self.weights_changed()
        return metrics

    def hf_weights(self) -> Iterator[Tuple[str, torch.Tensor]]:
        """Collective over this rank's TP x PP group (see ``model.iter_hf_weights``)."""
        return iter_hf_weights(self.model, self.spec, self.layout, self.groups, vpp=self.vpp)

    @property
    def context_length(self) -> Optional[int]:
        return self.spec.max_position_embeddings

    def prompt_token_counts(self, texts: Sequence[str]) -> List[int]:
        return [
            len(ids)
            for ids in encode_prompts(self.tokenizer, list(texts), self.cfg.use_chat_template)
        ]

    def hf_source_dir(self) -> Optional[str]:
        return self.path

    def save_pretrained(self, path: str) -> None:
        """Collective: the model streamed to rank 0 tensor by tensor and written as an HF
        folder (vocabulary padding removed) through ``atomic_folder``."""
        if self.groups.dp_rank != 0 and not self.spec.num_experts:
            return  # (experts are spread over DP replicas: every rank serves the gathers)
        writer = dist.get_rank() == 0 if dist.is_initialized() else True
        weights = self.hf_weights()
        if not writer:
            for _ in weights:  # serve the collectives
                pass
            return
        entries = [(n, hf_shape(n, self.spec), self.dtype) for n in hf_names(self.spec)]
        with atomic_folder(path) as tmp:
            write_hf_weights(tmp, weights, entries)  # the converter's writer
            ckpt.write_model_files(self, tmp)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """This rank's shard under local names (chunk i prefixed ``chunk<i>.``); not the
        distributed optimizer's state."""
        n = len(ckpt.policy_stages(self))
        if n == 1:
            return ckpt.policy_tensors(self)
        return {
            f"chunk{i}.{k}": v for i in range(n) for k, v in ckpt.policy_tensors(self, i).items()
        }

    def save_checkpoint(self, folder: str) -> List[str]:
        """Collective: the shard files this rank wrote (rank 0 adds config + tokenizer)."""
        wrote = ckpt.save_policy(self, folder)
        if self.groups.is_main:
            ckpt.write_model_files(self, Path(folder))
        return wrote

    def load_checkpoint(self, folder: str) -> bool:
        """A checkpoint written at any TP x PP layout, with either optimizer."""
        ckpt.load_policy(self, folder)
        self.weights_changed()
        if self._own_engine is not None:  # (the trainer refits any other engine after a resume)
            self._own_engine.sync_weights(self)
        return True

    def load_state_dict(self, state: dict) -> None:  # the trainer uses load_checkpoint
        raise NotImplementedError(
            "MegatronBackend restores with load_checkpoint(folder) (sharded files)"
        )

    def shutdown(self) -> None:
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
