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
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Union

import torch
import torch.nn.functional as F

from nemo_d3s.backends.base import GenerationConfig, LossFn, PolicyBackend, Rollouts, TokenBatch
from nemo_d3s.backends.hf.config import HFBackendConfig
from nemo_d3s.backends.hf.loading import load_model_and_tokenizer, resolve_autocast, resolve_device
from nemo_d3s.backends.hf.rollout import encode_prompts, real_length, right_padded_batch
from nemo_d3s.backends.hf.sampling import decode_hf_generate, decode_seeded, prompt_seeds, row_seed
from nemo_d3s.core.entropy import entropy_and_logprobs


def _lr_lambda(cfg: HFBackendConfig):
    """LR multiplier of optimizer step ``step``: linear warm-up, then constant/linear/cosine."""
    if cfg.scheduler not in ("constant", "linear", "cosine"):
        raise ValueError(f"scheduler must be constant, linear or cosine; got {cfg.scheduler!r}")
    if cfg.scheduler != "constant" and not cfg.total_steps:
        raise ValueError(f"scheduler={cfg.scheduler!r} needs total_steps > 0, got {cfg.total_steps!r}")
    warm, total, floor = cfg.warmup_steps, cfg.total_steps or 1, cfg.min_lr_ratio

    def fn(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        if cfg.scheduler == "constant":
            return 1.0
        progress = min(1.0, (step - warm) / max(1, total - warm))
        shape = 1.0 - progress if cfg.scheduler == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        return floor + (1.0 - floor) * shape

    return fn


class HFBackend(PolicyBackend):
    """Policy (+ frozen reference) transformers model with AdamW.

    dp_group: the data-parallel process group whose ranks each hold a different part of the
    step's batch; gradients are SUM-all-reduced over it (the loss is already divided by the
    global denominator). None = the default group when torch.distributed is initialised
    with world size > 1, else no reduction.
    """

    def __init__(self, cfg: HFBackendConfig, dp_group=None) -> None:
        if cfg.sampler not in ("seeded", "hf_generate"):
            raise ValueError(f"sampler must be 'seeded' or 'hf_generate', got {cfg.sampler!r}")
        self.cfg = cfg
        self.device = resolve_device(cfg.device)
        self.autocast_dtype = resolve_autocast(cfg.autocast, self.device)
        self.model, self.tokenizer = load_model_and_tokenizer(cfg, self.device)
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
            self.params, lr=cfg.lr, betas=tuple(cfg.adam_betas), eps=cfg.adam_eps, weight_decay=cfg.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, _lr_lambda(cfg))
        self.dp_group = dp_group
        self.eos_ids = self._eos_ids()
        self.pad_id = int(self.tokenizer.pad_token_id)
        self.use_chat_template = cfg.use_chat_template

    # ------------------------------------------------------------------ helpers
    def _eos_ids(self) -> List[int]:
        ids = {int(self.tokenizer.eos_token_id)}
        gen_eos = getattr(self.model.generation_config, "eos_token_id", None)
        if gen_eos is not None:
            ids.update(int(i) for i in (gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos]))
        vocab = self.tokenizer.get_vocab()
        ids.update(vocab[tok] for tok in self.cfg.stop_tokens if tok in vocab)
        return sorted(ids)

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def _dp_world(self) -> int:
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return 1
        return torch.distributed.get_world_size(self.dp_group)

    def _token_logprobs(self, model, ids: torch.Tensor, attn: torch.Tensor, resp: torch.Tensor, with_entropy: bool):
        """Forward one micro-batch. ids, attn, resp [b, L] on device -> (logprobs [b, L] f32,
        entropy [b, L] f32 or None), token-aligned, zero where attn is False.

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
                input_ids=ids, attention_mask=attn.long(), use_cache=False, logits_to_keep=L - first + 1
            ).logits
        ent, lp = entropy_and_logprobs(logits[:, :-1], ids[:, first:])
        pad = (first, 0)
        lp = F.pad(lp.float(), pad) * attn
        ent = F.pad(ent.float(), pad) * attn if with_entropy else None
        return lp, ent

    # ------------------------------------------------------------------ generation
    @property
    def supports_prompt_seeds(self) -> bool:
        """True with the seeded sampler: ``generate`` takes one seed per prompt and a
        prompt's samples do not depend on the rest of the batch, so the trainer samples all
        prompts in one batched call and any rank layout gives the same samples."""
        return self.cfg.sampler == "seeded"

    @torch.no_grad()
    def generate(
        self, prompts: List[str], n_samples: int, cfg: GenerationConfig, seed: Union[int, Sequence[int]]
    ) -> Rollouts:
        """``n_samples`` completions of each prompt (a plain user message; the chat template
        is applied here). Rows are prompt-major: rows [i*n, (i+1)*n) answer prompts[i].

        ``seed``: with ``sampler="seeded"``, one int per prompt, or an int s meaning seeds
        [s, s+1, ...]; sample j of prompt i comes from a private generator seeded from
        (seed_i, j), so prompt i's samples depend only on its text, its seed and the model,
        not on the other prompts, the padding or ``generation_batch_size`` (up to float
        noise of padded matmuls, which flips a sample only when a uniform lands within
        ~1e-6 of a cdf boundary). With ``sampler="hf_generate"``, one int for the call.
        The global RNG state is untouched either way.

        Returns a right-padded TokenBatch [B = len(prompts) * n_samples, S] on the CPU whose
        response_mask covers the response up to and including the first stop token.
        """
        if n_samples < 1:
            raise ValueError(f"n_samples must be >= 1, got {n_samples}")
        if not prompts:
            raise ValueError("prompts must be non-empty")
        if cfg.do_sample and not cfg.temperature > 0:
            raise ValueError(f"temperature must be > 0 when sampling, got {cfg.temperature}")
        if not 0.0 < cfg.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {cfg.top_p}")
        if cfg.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {cfg.max_new_tokens}")
        if self.supports_prompt_seeds:
            seeds = prompt_seeds(seed, len(prompts))
        elif isinstance(seed, int):
            seeds = [seed]
        else:
            raise ValueError("sampler='hf_generate' takes one int seed per call, not one per prompt")
        encoded = encode_prompts(self.tokenizer, prompts, self.use_chat_template)
        prompt_ids = [ids for ids in encoded for _ in range(n_samples)]
        chunk = self.cfg.generation_batch_size or len(prompt_ids)
        common = dict(cfg=cfg, pad_id=self.pad_id, eos_ids=self.eos_ids, device=self.device, autocast=self._autocast)
        responses, finished = [], []
        was_training = self.model.training
        self.model.eval()
        start = time.perf_counter()
        try:
            for lo in range(0, len(prompt_ids), chunk):
                rows = prompt_ids[lo: lo + chunk]
                if self.supports_prompt_seeds:
                    row_seeds = [row_seed(seeds[r // n_samples], r % n_samples) for r in range(lo, lo + len(rows))]
                    r, f = decode_seeded(self.model, rows, row_seeds, **common)
                else:
                    r, f = decode_hf_generate(self.model, rows, seeds[0] + lo, **common)
                responses += r
                finished += f
        finally:
            self.model.train(was_training)
        seconds = time.perf_counter() - start
        batch = right_padded_batch(prompt_ids, responses, self.pad_id)
        n_tokens = sum(len(r) for r in responses)
        texts = [self.tokenizer.decode(r, skip_special_tokens=True) for r in responses]
        stats = {
            "gen_seconds": seconds,
            "gen_tokens": float(n_tokens),
            "gen_tokens_per_s": n_tokens / max(seconds, 1e-9),
            "response_len_mean": n_tokens / len(responses),
            "finished_frac": sum(finished) / len(finished),
        }
        prompt_index = torch.arange(len(prompts)).repeat_interleave(n_samples)
        return Rollouts(batch, prompt_index, texts, torch.tensor(finished, dtype=torch.bool), stats)

    # ------------------------------------------------------------------ scoring
    @torch.no_grad()
    def compute_logprobs(self, batch: TokenBatch, *, with_entropy: bool, reference: bool = False, micro_batch_size: int = 8):
        """(logprobs [B, S] f32, entropy [B, S] f32 or None) on the CPU, token-aligned
        (position t scores token t from logits at t-1). Scored: every real position from the
        first response token of the row's micro-batch on (so every response token); the
        prompt before it, position 0 and padding hold 0.

        No grad; micro-batches of ``micro_batch_size`` rows, each cut to its longest row.
        ``reference=True`` scores with the frozen reference model and returns no entropy.
        """
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        if reference and self.ref_model is None:
            raise ValueError("reference=True but the backend was built with use_reference=False")
        model = self.ref_model if reference else self.model
        with_entropy = with_entropy and not reference
        B, S = batch.input_ids.shape
        logprobs = torch.zeros((B, S), dtype=torch.float32)
        entropy = torch.zeros((B, S), dtype=torch.float32) if with_entropy else None
        was_training = model.training
        model.eval()
        for lo in range(0, B, micro_batch_size):
            mb = batch.select(torch.arange(lo, min(B, lo + micro_batch_size)))
            L = real_length(mb.attention_mask)
            if L < 2:
                continue  # nothing to score: position 0 is 0 by contract
            ids, attn = mb.input_ids[:, :L].to(self.device), mb.attention_mask[:, :L].to(self.device)
            lp, ent = self._token_logprobs(model, ids, attn, mb.response_mask[:, :L].to(self.device), with_entropy)
            logprobs[lo: lo + len(mb), :L] = lp.float().cpu()
            if with_entropy:
                entropy[lo: lo + len(mb), :L] = ent.float().cpu()
        model.train(was_training)
        return logprobs, entropy

    # ------------------------------------------------------------------ training
    def accumulate_gradients(self, batch: TokenBatch, loss_fn: LossFn, micro_batch_size: int) -> Dict[str, float]:
        """Forward + backward of every micro-batch, then the DP gradient all-reduce; leaves
        the summed gradient in ``.grad`` of every parameter (zeros when this rank had no
        rows, so every rank joins the collective). ``train_step`` = this + clip + step.

        Collectives: one all_reduce(SUM) per gradient dtype over ``dp_group`` when the DP
        world size > 1. Memory: one flat copy of the gradients during the all-reduce.
        """
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        self.model.train()
        B, S = batch.input_ids.shape
        total_loss, n_mb = 0.0, 0
        for lo in range(0, B, micro_batch_size):
            rows = torch.arange(lo, min(B, lo + micro_batch_size))
            mb = batch.select(rows)
            L = max(real_length(mb.attention_mask), 1)
            ids, attn = mb.input_ids[:, :L].to(self.device), mb.attention_mask[:, :L].to(self.device)
            resp = mb.response_mask[:, :L].to(self.device)
            lp, _ = self._token_logprobs(self.model, ids, attn, resp, with_entropy=False)
            # Give loss_fn the full width S so it can index its own [B, S] tensors by rows.
            lp = F.pad(lp.float(), (0, S - L))
            loss = loss_fn(lp, rows)
            loss.backward()
            total_loss += float(loss.detach())
            n_mb += 1
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self._dp_world() > 1:
            self._all_reduce_grads()
        return {"loss": total_loss, "n_micro_batches": float(n_mb)}

    def _all_reduce_grads(self) -> None:
        by_dtype: Dict[torch.dtype, List[torch.Tensor]] = {}
        for p in self.params:
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
        for grads in by_dtype.values():
            # One flat bucket: a single collective instead of one per parameter tensor.
            flat = torch.cat([g.reshape(-1) for g in grads])
            torch.distributed.all_reduce(flat, op=torch.distributed.ReduceOp.SUM, group=self.dp_group)
            offset = 0
            for g in grads:
                g.copy_(flat[offset: offset + g.numel()].view_as(g))
                offset += g.numel()

    def train_step(self, batch: TokenBatch, loss_fn: LossFn, micro_batch_size: int) -> Dict[str, float]:
        """Micro-batched forward/backward of ``batch`` (this rank's rows; may be empty),
        DP gradient SUM all-reduce, global-norm clipping, one AdamW step.

        ``loss_fn(logprobs [b, S] f32 on the model device, rows [b] long on CPU)`` must return
        the micro-batch loss already divided by the global denominator. A non-finite
        gradient norm skips the update (identically on all ranks: the norm is post-reduce).
        Returns {"grad_norm", "lr", "loss" (this rank's sum), "n_micro_batches", "skipped"}.
        """
        metrics = self.accumulate_gradients(batch, loss_fn, micro_batch_size)
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip and self.cfg.grad_clip > 0 else float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
        lr = float(self.optimizer.param_groups[0]["lr"])
        skipped = not math.isfinite(grad_norm)
        if not skipped:
            self.optimizer.step()
            self.scheduler.step()
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

    def save_pretrained(self, path: str) -> None:
        """Write the policy as a Hugging Face folder (safetensors, config, generation config,
        tokenizer) that ``AutoModelForCausalLM.from_pretrained(path)`` loads back.

        Written to a temporary sibling and renamed into place, replacing any old folder.
        """
        dest = Path(path)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp, old = dest.parent / f".{dest.name}.tmp-{tag}", dest.parent / f".{dest.name}.old-{tag}"
        try:
            self.model.save_pretrained(str(tmp))
            self.tokenizer.save_pretrained(str(tmp))
            if dest.exists():
                os.rename(dest, old)
            os.rename(tmp, dest)
        finally:
            for leftover in (tmp, old):
                if leftover.exists():
                    shutil.rmtree(leftover, ignore_errors=True)
