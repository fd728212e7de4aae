"""``HFBackend``: a transformers causal LM on CPU or one GPU, optionally data parallel.

Every returned tensor lives on the CPU, except the ``logprobs`` handed to ``loss_fn``: they
carry the graph on the model device (``rows`` is a CPU LongTensor into the step's batch).
"""

from __future__ import annotations

import contextlib
import copy
import math
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Union

import torch
import torch.nn.functional as F

from nemo_d3s.backends.base import (
    GenerationConfig,
    LossFn,
    Policy,
    RolloutEngine,
    Rollouts,
    Scores,
    TokenBatch,
)
from nemo_d3s.backends.hf.config import HFBackendConfig
from nemo_d3s.backends.hf.engine import HFRolloutEngine, ReplicaEngine, SamplerModel
from nemo_d3s.backends.hf.forward import micro_batch_forward
from nemo_d3s.backends.hf.packed import VARLEN_ATTENTION
from nemo_d3s.backends.hf.loading import (
    TINY_RANDOM,
    load_model_and_tokenizer,
    resolve_autocast,
    resolve_device,
    resolve_model_path,
)
from nemo_d3s.backends.hf.rollout import encode_prompts, stop_token_ids
from nemo_d3s.backends.hf.routing import RouterHooks, check_replay, empty_routing
from nemo_d3s.backends.lr import lr_multiplier
from nemo_d3s.distributed.groups import ParallelGroups, init_world
from nemo_d3s.distributed.normalizers import StepNormalizer
from nemo_d3s.files import atomic_folder


def _lr_lambda(cfg: HFBackendConfig):
    """LR multiplier per optimizer step: linear warm-up, then constant/linear/cosine."""
    return lr_multiplier(cfg.scheduler, cfg.warmup_steps, cfg.total_steps, cfg.min_lr_ratio)


class HFBackend(Policy):
    """Transformers policy (+ frozen reference) with AdamW, data parallel over the torchrun
    world (``groups`` None: ``init_world``); every rank holds the whole model."""

    def __init__(self, cfg: HFBackendConfig, groups: Optional[ParallelGroups] = None) -> None:
        if cfg.sampler not in ("seeded", "hf_generate"):
            raise ValueError(f"sampler must be 'seeded' or 'hf_generate', got {cfg.sampler!r}")
        self.cfg = cfg
        self.groups = (
            groups if groups is not None else init_world(cfg.device, cfg.dist_timeout_minutes)
        )
        if self.groups.tp_size * self.groups.pp_size * self.groups.cp_size > 1:
            raise ValueError(
                "the hf backend is data parallel only; use model.backend=megatron for TP/PP/CP"
            )
        self.device = resolve_device(cfg.device)
        self.autocast_dtype = resolve_autocast(cfg.autocast, self.device)
        self.model, self.tokenizer = load_model_and_tokenizer(cfg, self.device)
        # a mixture of experts' routing; kept for the backward's recomputed forward under
        # gradient checkpointing (routing.py)
        self.router_hooks = RouterHooks(self.model, recompute=bool(cfg.gradient_checkpointing))
        # packed rows by default only where attention takes them as varlen (no [T, T] mask)
        self.pack = (
            bool(cfg.pack_sequences)
            if cfg.pack_sequences is not None
            else self.device.type == "cuda" and cfg.attn_implementation in VARLEN_ATTENTION
        )
        if cfg.gradient_checkpointing:
            # transformers 5 renamed the method; 4.x only has the old name.
            kwargs = {"use_reentrant": False}
            if hasattr(self.model, "activation_checkpointing_enable"):
                self.model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            else:
                self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        self.ref_model = None
        if cfg.use_reference:
            self.ref_model = copy.deepcopy(self.model).eval()
            self.ref_model.requires_grad_(False)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params,
            lr=cfg.lr,
            betas=tuple(cfg.adam_betas),
            eps=cfg.adam_eps,
            weight_decay=cfg.weight_decay,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, _lr_lambda(cfg))
        self.eos_ids = self._eos_ids()
        self.pad_id = int(self.tokenizer.pad_token_id)
        self.use_chat_template = cfg.use_chat_template
        self.rollout_engine = HFRolloutEngine(self)

    # ------------------------------------------------------------------ helpers
    def _eos_ids(self) -> List[int]:
        return stop_token_ids(self.tokenizer, self.model.generation_config, self.cfg.stop_tokens)

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def _forward(self, model, batch, micro_batch_size, micro_batch_tokens, with_entropy, **kw):
        """:func:`forward.micro_batch_forward` with this policy's device, autocast, scoring
        temperature and packing."""
        return micro_batch_forward(
            model,
            batch,
            micro_batch_size,
            micro_batch_tokens,
            with_entropy,
            device=self.device,
            autocast=self._autocast,
            temperature=self.cfg.logit_temperature,
            pack=self.pack,
            **kw,
        )

    # ------------------------------------------------------------------ generation
    def generate(
        self,
        prompts: List[str],
        n_samples: int,
        cfg: GenerationConfig,
        seed: Union[int, Sequence[int]],
    ) -> Rollouts:
        """``self.rollout_engine.generate``; an int seed s means per-prompt seeds s, s+1, ..."""
        return self.rollout_engine.generate(prompts, n_samples, cfg, seed)

    def weights_copy_engine(self) -> RolloutEngine:
        """The seeded sampler on a copy of the model (and of the tokenizer, which is not
        thread-safe), refitted by ``sync_weights``: it generates while this model trains."""
        model = copy.deepcopy(self.model).eval()
        model.requires_grad_(False)
        for p in model.parameters():
            p.grad = None
        replica = SamplerModel(
            model,
            copy.deepcopy(self.tokenizer),
            self.cfg,
            self.pad_id,
            list(self.eos_ids),
            self.device,
            bool(self.use_chat_template),
            autocast=self._autocast,
        )
        return ReplicaEngine(replica)

    # ------------------------------------------------------------------ scoring
    @torch.no_grad()
    def score(
        self,
        batch: TokenBatch,
        *,
        with_entropy: bool,
        reference: bool = False,
        micro_batch_size: int = 8,
        micro_batch_tokens: int = 0,
    ) -> Scores:
        """``Policy.score``: every response token is scored; positions before the micro-batch's
        first response token, position 0 and padding hold 0."""
        if reference and self.ref_model is None:
            raise ValueError("reference=True but the backend was built with use_reference=False")
        model = self.ref_model if reference else self.model
        with_entropy = with_entropy and not reference
        B, S = batch.input_ids.shape
        logprobs = torch.zeros((B, S), dtype=torch.float32)
        entropy = torch.zeros((B, S), dtype=torch.float32) if with_entropy else None
        was_training = model.training
        model.eval()
        fed = 0
        check_replay(batch, self.router_hooks, reference)
        hooks = self.router_hooks if self.router_hooks.is_moe and not reference else None
        routed = None
        if hooks:  # the trainer's own routing, for the engine's to be compared with
            L, K = len(hooks.routers), int(self.model.config.num_experts_per_tok)
            routed = empty_routing(B, S, L, K)
        for rows, lp, ent, fed_mb, routing in self._forward(
            model,
            batch,
            micro_batch_size,
            micro_batch_tokens,
            with_entropy,
            skip_unscored=True,
            hooks=hooks,
        ):
            fed += fed_mb
            W = lp.shape[1]
            logprobs[rows, :W] = lp.float().cpu()
            if with_entropy:
                entropy[rows, :W] = ent.float().cpu()
            if routing is not None:
                routed[rows, : routing.shape[1]] = routing
        model.train(was_training)
        stats = {
            "fed_tokens": float(fed),
            "attended_tokens": float(batch.attention_mask.sum()) if fed else 0.0,
        }
        return Scores(logprobs, entropy, stats, routed_experts=routed)

    # ------------------------------------------------------------------ training
    def accumulate_gradients(
        self,
        batch: TokenBatch,
        loss_fn: LossFn,
        micro_batch_size: int,
        *,
        denominator: float = 1.0,
        micro_batch_tokens: int = 0,
    ) -> Dict[str, torch.Tensor]:
        """Leave grad(global loss sum / ``denominator``) in every ``.grad`` (a rank without
        rows still joins); ``train_step`` = this + clip + step.

        Returns this rank's sums as 0-d tensors, no host sync. Collectives: one fp32 (at
        least) all-reduce per gradient dtype over ``groups.dp``, holding one flat gradient copy.
        """
        self.model.train()
        B, S = batch.input_ids.shape
        scale = StepNormalizer(
            float(denominator), self.groups.dp_size, 1, megatron_schedule=False
        ).loss_scale
        sums: Dict[str, torch.Tensor] = {}
        fed = n_mb = 0
        check_replay(batch, self.router_hooks, False)
        hooks = self.router_hooks if batch.routed_experts is not None else None
        for rows, lp, _, fed_mb, _ in self._forward(
            self.model,
            batch,
            micro_batch_size,
            micro_batch_tokens,
            False,
            skip_unscored=False,
            hooks=hooks,
        ):
            fed, n_mb = fed + fed_mb, n_mb + 1
            # Give loss_fn the full width S so it can index its own [B, S] tensors by rows.
            lp = F.pad(lp.float(), (0, S - lp.shape[1]))
            out = loss_fn(lp, rows)
            loss, metrics = (
                (out, {}) if isinstance(out, torch.Tensor) else (out.loss, out.metric_tensors)
            )
            (loss * scale).backward()
            for k, v in (("loss_sum", loss.detach()), *metrics.items()):
                v = v.detach().to(torch.float64)
                sums[k] = sums[k] + v if k in sums else v
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.groups.data_parallel:
            self._average_grads()
        sums["n_micro_batches"] = torch.tensor(float(n_mb), dtype=torch.float64)
        sums["fed_tokens"] = torch.tensor(float(fed), dtype=torch.float64)
        sums["attended_tokens"] = torch.tensor(
            float(batch.attention_mask.sum()), dtype=torch.float64
        )
        return sums

    def _average_grads(self) -> None:
        by_dtype: Dict[torch.dtype, List[torch.Tensor]] = {}
        for p in self.params:
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
        for grads in by_dtype.values():
            # One flat bucket: a single collective instead of one per parameter tensor; in
            # fp32 at least, as Megatron's grad_reduce_in_fp32 (megatron/optimizer.py): a
            # bf16 sum over ranks rounds at every add, and then differs with the DP size.
            flat = torch.cat([g.reshape(-1) for g in grads])
            flat = flat.to(torch.promote_types(flat.dtype, torch.float32))
            torch.distributed.all_reduce(
                flat, op=torch.distributed.ReduceOp.SUM, group=self.groups.dp
            )
            flat /= self.groups.dp_size
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()

    def train_step(
        self,
        batch: TokenBatch,
        loss_fn: LossFn,
        micro_batch_size: int,
        *,
        denominator: float,
        micro_batch_tokens: int = 0,
    ) -> Dict[str, float]:
        """``Policy.train_step`` with AdamW; a non-finite (post-reduce) norm skips the update
        on every rank. One host copy for all metrics."""
        sums = self.accumulate_gradients(
            batch,
            loss_fn,
            micro_batch_size,
            denominator=denominator,
            micro_batch_tokens=micro_batch_tokens,
        )
        max_norm = (
            self.cfg.grad_clip if self.cfg.grad_clip and self.cfg.grad_clip > 0 else float("inf")
        )
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm)
        keys = list(sums)
        values = torch.stack(
            [sums[k].cpu() for k in keys] + [grad_norm.detach().cpu().to(torch.float64)]
        ).tolist()
        metrics = dict(zip(keys, values[:-1]))
        grad_norm = values[-1]
        lr = float(self.optimizer.param_groups[0]["lr"])
        skipped = not math.isfinite(grad_norm)
        if not skipped:
            self.optimizer.step()
            self.scheduler.step()
            self.weights_changed()
        self.optimizer.zero_grad(set_to_none=True)
        metrics.update(grad_norm=grad_norm, lr=lr, skipped=float(skipped))
        return metrics

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if "scheduler" in state:
            self.scheduler.load_state_dict(state["scheduler"])
        self.weights_changed()

    def hf_weights(self):
        """The state dict, already in HF names (tied embeddings under both names)."""
        yield from self.model.state_dict().items()

    @property
    def context_length(self) -> Optional[int]:
        n = getattr(self.model.config, "max_position_embeddings", None)
        return n if isinstance(n, int) and n > 0 else None

    def prompt_token_counts(self, texts: Sequence[str]) -> List[int]:
        return [
            len(ids) for ids in encode_prompts(self.tokenizer, list(texts), self.use_chat_template)
        ]

    def hf_source_dir(self) -> Optional[str]:
        return None if self.cfg.model == TINY_RANDOM else str(resolve_model_path(self.cfg.model))

    def _write_model_files(self, folder: Path) -> None:
        """model.safetensors + config.json + generation_config.json, on every rank (the
        model's ``save_pretrained`` writes on rank 0 only)."""
        from safetensors.torch import save_file

        folder.mkdir(parents=True, exist_ok=True)
        state = self.model.state_dict()
        if getattr(self.model.config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)  # the embedding; transformers re-ties it on load
        save_file(
            {k: v.detach().contiguous().cpu() for k, v in state.items()},
            str(folder / "model.safetensors"),
            metadata={"format": "pt"},
        )
        self.model.config.save_pretrained(str(folder))
        if getattr(self.model, "generation_config", None) is not None:
            self.model.generation_config.save_pretrained(str(folder))

    def save_pretrained(self, path: str) -> None:
        """Write a Hugging Face folder (weights, configs, tokenizer) through ``atomic_folder``."""
        with atomic_folder(path) as tmp:
            self._write_model_files(tmp)
            self.tokenizer.save_pretrained(str(tmp))
