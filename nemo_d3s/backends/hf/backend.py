"""``HFBackend``: a transformers causal LM on CPU or one GPU, optionally data parallel.

Device convention: every tensor the backend returns (rollout batches, log-probs, entropy)
lives on the CPU, which is where the trainer's selection math runs; the backend moves
inputs to its compute device itself. The one exception is the ``logprobs`` argument that
``train_step`` hands to ``loss_fn``: it lives on the model device (it carries the graph),
so the loss function moves its own tensors there (``x.to(logprobs.device)``).
``rows`` given to ``loss_fn`` is a CPU LongTensor indexing the step's batch.
"""

from __future__ import annotations

import contextlib
import copy
import math
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Union

import torch
import torch.nn.functional as F

from nemo_d3s.backends.base import GenerationConfig, LossFn, Policy, Rollouts, Scores, TokenBatch
from nemo_d3s.backends.hf.config import HFBackendConfig
from nemo_d3s.backends.hf.engine import HFRolloutEngine
from nemo_d3s.backends.hf.packed import VARLEN_ATTENTION, pack_batch, packed_logprobs
from nemo_d3s.backends.hf.loading import (
    TINY_RANDOM,
    load_model_and_tokenizer,
    resolve_autocast,
    resolve_device,
    resolve_model_path,
)
from nemo_d3s.backends.hf.rollout import encode_prompts, real_length, stop_token_ids
from nemo_d3s.backends.lr import lr_multiplier
from nemo_d3s.core.entropy import entropy_and_logprobs
from nemo_d3s.core.micro_batches import plan_rows, row_lengths
from nemo_d3s.distributed.groups import ParallelGroups, init_world
from nemo_d3s.distributed.normalizers import StepNormalizer
from nemo_d3s.files import atomic_folder


def _lr_lambda(cfg: HFBackendConfig):
    """LR multiplier of optimizer step ``step``: linear warm-up, then constant/linear/cosine."""
    return lr_multiplier(cfg.scheduler, cfg.warmup_steps, cfg.total_steps, cfg.min_lr_ratio)


class HFBackend(Policy):
    """Policy (+ frozen reference) transformers model with AdamW, data parallel over the
    torchrun world (every rank holds the whole model).

    groups: the parallel layout; None = build it (``init_world``: join torchrun's process
    group when ``WORLD_SIZE > 1``, gloo on CPU / NCCL on CUDA, or reuse one that exists).
    Only ``groups.dp`` may be set: this backend does not shard the model.
    """

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

    def _token_logprobs(
        self, model, ids: torch.Tensor, attn: torch.Tensor, resp: torch.Tensor, with_entropy: bool
    ):
        """Forward one micro-batch. ids, attn [b, L] on device, resp [b, L] on the CPU (where
        the first response column is read without waiting for the device) -> (logprobs
        [b, L] f32, entropy [b, L] f32 or None), token-aligned, zero where attn is False.

        Only positions from the micro-batch's first response token on are scored (earlier
        ones hold 0): the LM head and the softmax run on ``logits_to_keep`` positions, not
        on the prompt, which is most of the sequence in short-answer RL.
        Memory: the [b, L - first + 1, V] logits (plus the softmax workspace).
        """
        L = ids.shape[1]
        has_resp = resp.any(dim=0)
        first = max(int(has_resp.int().argmax()), 1) if bool(has_resp.any()) else 1
        with self._autocast():
            logits = model(
                input_ids=ids,
                attention_mask=attn.long(),
                use_cache=False,
                logits_to_keep=L - first + 1,
            ).logits
        ent, lp = entropy_and_logprobs(logits[:, :-1], ids[:, first:])
        pad = (first, 0)
        lp = F.pad(lp.float(), pad) * attn
        ent = F.pad(ent.float(), pad) * attn if with_entropy else None
        return lp, ent

    def _forward(
        self,
        model,
        batch,
        micro_batch_size,
        micro_batch_tokens,
        with_entropy,
        *,
        skip_unscored: bool,
    ):
        """(rows, logprobs [n, W], entropy [n, W] or None, positions fed) per micro-batch,
        W <= S: packs, else rows cut to their longest (``skip_unscored``: none shorter
        than 2)."""
        if self.pack:
            for pack in pack_batch(batch, micro_batch_size, micro_batch_tokens):
                lp, ent = packed_logprobs(
                    model, batch, pack, self.device, with_entropy, self._autocast
                )
                yield pack.rows, lp, ent, pack.width
            return
        for rows in self._plan(batch, micro_batch_size, micro_batch_tokens):
            mb = batch.select(rows)
            L = real_length(mb.attention_mask)
            if L < 2 and skip_unscored:
                continue  # nothing to score: position 0 is 0 by contract
            L = max(L, 1)
            ids, attn = (
                mb.input_ids[:, :L].to(self.device),
                mb.attention_mask[:, :L].to(self.device),
            )
            lp, ent = self._token_logprobs(model, ids, attn, mb.response_mask[:, :L], with_entropy)
            yield rows, lp, ent, len(rows) * L

    # ------------------------------------------------------------------ generation
    @property
    def supports_prompt_seeds(self) -> bool:
        return self.rollout_engine.prompt_seeds

    def generate(
        self,
        prompts: List[str],
        n_samples: int,
        cfg: GenerationConfig,
        seed: Union[int, Sequence[int]],
    ) -> Rollouts:
        """Convenience for scripts and tests: ``self.rollout_engine.generate`` (see
        :class:`~nemo_d3s.backends.hf.engine.HFRolloutEngine`); an int seed s means per-prompt
        seeds [s, s+1, ...] with the seeded sampler."""
        return self.rollout_engine.generate(prompts, n_samples, cfg, seed)

    # ------------------------------------------------------------------ scoring
    @staticmethod
    def _plan(
        batch: TokenBatch, micro_batch_size: int, micro_batch_tokens: int
    ) -> List[torch.Tensor]:
        """Row index tensors of the micro-batches (``core.micro_batches.plan_rows``)."""
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        return plan_rows(row_lengths(batch.attention_mask), micro_batch_size, micro_batch_tokens)

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
        """Scores(logprobs [B, S] f32, entropy [B, S] f32 or None) on the CPU, token-aligned
        (position t scores token t from logits at t-1). Scored: every real position from the
        first response token of the row's micro-batch on (so every response token); the
        prompt before it, position 0 and padding hold 0.

        No grad; micro-batches of ``micro_batch_size`` rows or of ``micro_batch_tokens``
        positions (see ``Policy.score``), each cut to its longest row; ``stats`` counts the
        fed and attended positions. ``reference=True`` scores with the frozen reference
        model and returns no entropy.
        """
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
        for rows, lp, ent, fed_mb in self._forward(
            model, batch, micro_batch_size, micro_batch_tokens, with_entropy, skip_unscored=True
        ):
            fed += fed_mb
            W = lp.shape[1]
            logprobs[rows, :W] = lp.float().cpu()
            if with_entropy:
                entropy[rows, :W] = ent.float().cpu()
        model.train(was_training)
        stats = {
            "fed_tokens": float(fed),
            "attended_tokens": float(batch.attention_mask.sum()) if fed else 0.0,
        }
        return Scores(logprobs, entropy, stats)

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
        """Forward + backward of every micro-batch, then the DP gradient reduction; leaves
        grad(sum over all ranks' loss sums / ``denominator``) in ``.grad`` of every parameter
        (zeros when no rank had rows; a rank without rows still joins the collective).
        ``train_step`` = this + clip + step.

        Each micro-batch's loss sum is multiplied by the step normaliser's scale
        ``dp_size / denominator`` and the gradients are then AVERAGED over ``groups.dp``
        (what Megatron's DDP does), which gives the gradient of the global mean whatever
        the micro-batch size, the token budget or the number of ranks. Returns this rank's
        sums as 0-d tensors on the model device (``loss_sum`` + the ``metric_tensors`` of
        ``loss_fn``, ``fed_tokens``, ``attended_tokens``), with no host sync. Collectives: one
        all_reduce per gradient dtype over ``groups.dp``, in fp32 for 16-bit gradients. Memory:
        one flat copy of the gradients during the all-reduce (fp32: twice a bf16 model's
        gradient bytes).
        """
        self.model.train()
        B, S = batch.input_ids.shape
        scale = StepNormalizer(
            float(denominator), self.groups.dp_size, 1, megatron_schedule=False
        ).loss_scale
        sums: Dict[str, torch.Tensor] = {}
        fed = n_mb = 0
        for rows, lp, _, fed_mb in self._forward(
            self.model, batch, micro_batch_size, micro_batch_tokens, False, skip_unscored=False
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
        """Micro-batched forward/backward of ``batch`` (this rank's rows; may be empty), the
        DP gradient average, global-norm clipping, one AdamW step (see ``Policy.train_step``
        and :meth:`accumulate_gradients`).

        ``loss_fn(logprobs [b, S] f32 on the model device, rows [b] long on CPU)`` returns a
        LossOutput whose ``loss`` is the micro-batch's loss SUM (a bare tensor is accepted as
        a sum without metrics); ``denominator``: the step's GLOBAL denominator. A non-finite
        gradient norm skips the update (identically on all ranks: the norm is post-reduce).
        Returns {"grad_norm", "lr", "skipped", "n_micro_batches", "loss_sum", <metric sums>}
        with one host copy for all of them.
        """
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
        """(name, tensor) of the policy's state dict: already Hugging Face names and layout
        (tied embeddings appear under both names, as transformers' state_dict has them)."""
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
        """model.safetensors + config.json + generation_config.json. Not the model's own
        ``save_pretrained``: under torch.distributed transformers writes on rank 0 only, and
        a vLLM engine per DP rank exports the policy on every rank."""
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
        """Write the policy as a Hugging Face folder (safetensors, config, generation config,
        tokenizer) that ``AutoModelForCausalLM.from_pretrained(path)`` loads back.

        Written through ``files.atomic_folder`` (a hidden sibling renamed into place,
        replacing any old folder). File modes follow the process umask (0644 under the usual
        022), like every other file of a run.
        """
        with atomic_folder(path) as tmp:
            self._write_model_files(tmp)
            self.tokenizer.save_pretrained(str(tmp))
