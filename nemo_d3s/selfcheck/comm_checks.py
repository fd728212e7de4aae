"""The project's collective helpers and the vocab-parallel kernel on gloo and NCCL, against
single-process references on every rank. ``collectives.*``: scalar all-reduce, count
all-gather, exact global top-K mask, last-stage broadcast; exact equality (plus all-reduce
latency). ``cluster.gloo_across_nodes``: a gloo group over every rank of the job, as the
model-parallel gloo twin is built (it connects across nodes only where gloo binds a shared
interface: ``GLOO_SOCKET_IFNAME``). ``vocab_parallel.*``: entropy, log-probs and their
gradient from uneven padded vocabulary shards against ``core.entropy`` on full fp32 logits;
bounds fp32 1e-5, bf16 1e-3, bf16 gradient 8e-3.
"""

from __future__ import annotations

import time
from typing import Any, Dict, List

import torch
import torch.distributed as dist

from nemo_d3s.selfcheck.base import Check, Context, max_abs_diff, need_world, within
from nemo_d3s.selfcheck.report import CheckFailed

__all__ = ["CHECKS"]

_K = 7  # tokens the global top-K keeps
_ALL_REDUCE_REPEATS = 20


def _group(ctx: Context, backend: str):
    """The world on ``backend``: the default group when it is that backend, else a new one
    (collective: every rank creates it)."""
    from nemo_d3s.distributed.timeouts import group_timeout

    if dist.get_backend() == backend:
        return dist.group.WORLD
    # the world's timeout (the self-check's --timeout), not the backend's default
    timeout = max(group_timeout(dist.group.WORLD).values())
    return dist.new_group(list(range(ctx.world)), backend=backend, timeout=timeout)


def _rank_scores(rank: int):
    """Rank ``rank``'s [B_r, S] scores and eligibility (B_r differs between ranks)."""
    g = torch.Generator().manual_seed(1000 + rank)
    scores = torch.rand(2 + rank % 3, 5, generator=g)
    eligible = torch.rand(scores.shape, generator=g) < 0.7
    return scores, eligible


def _collectives(ctx: Context, backend: str) -> Dict[str, Any]:
    from nemo_d3s.core.token_selection import top_k_mask
    from nemo_d3s.distributed.comm import all_gather_counts, collective_device
    from nemo_d3s.distributed.groups import ParallelGroups
    from nemo_d3s.distributed.pipeline import broadcast_from_last_stage
    from nemo_d3s.distributed.topk import global_top_k_mask

    need_world(ctx, 2, "a collective check")
    group = _group(ctx, backend)
    device = collective_device(group)
    out: Dict[str, Any] = {"ranks": ctx.world, "device": str(device)}
    problems: List[str] = []  # raised after the last collective (see Context)
    # the trainer's scalar all-reduce
    got = ParallelGroups(dp=group, device=device).sum({"x": float(ctx.rank + 1)})["x"]
    out["all_reduce_sum"] = got
    if got != ctx.world * (ctx.world + 1) / 2:
        problems.append(f"all-reduce SUM of 1..{ctx.world} gave {got}")
    t = torch.ones(1, device=device)
    dist.all_reduce(t, group=group)  # warm-up (communicator set-up)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(_ALL_REDUCE_REPEATS):
        dist.all_reduce(t, group=group)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    out["all_reduce_us"] = (time.perf_counter() - t0) / _ALL_REDUCE_REPEATS * 1e6
    # all-gather of counts
    counts = all_gather_counts(3 * ctx.rank + 1, group, device).cpu().tolist()
    if counts != [3 * r + 1 for r in range(ctx.world)]:
        problems.append(f"all_gather_counts gave {counts}")
    # exact global top-K against one process on the concatenation
    parts = [_rank_scores(r) for r in range(ctx.world)]
    scores, eligible = parts[ctx.rank]
    mine = global_top_k_mask(scores.to(device), eligible.to(device), _K, group).cpu()
    flat_s = torch.cat([s.reshape(-1) for s, _ in parts]).unsqueeze(0)
    flat_e = torch.cat([e.reshape(-1) for _, e in parts]).unsqueeze(0)
    want = top_k_mask(flat_s, flat_e, _K)[0]
    start = sum(s.numel() for s, _ in parts[: ctx.rank])
    out["top_k_kept_here"] = int(mine.sum())
    if not torch.equal(mine.reshape(-1), want[start : start + scores.numel()]):
        problems.append("global_top_k_mask differs from top_k_mask on the concatenated scores")
    # broadcast from the last stage (the world as a pipeline group)
    last = ctx.rank == ctx.world - 1
    x = torch.arange(12, dtype=torch.float32, device=device).reshape(3, 4) * 1.5 if last else None
    got_b = broadcast_from_last_stage(x, (3, 4), torch.float32, group, device=device)
    if not torch.equal(got_b.cpu(), torch.arange(12, dtype=torch.float32).reshape(3, 4) * 1.5):
        problems.append("broadcast_from_last_stage delivered other values")
    if problems:
        raise CheckFailed("; ".join(problems), out)
    return out


def _shard_bounds(v: int, world: int) -> List[int]:
    """Uneven contiguous split of ``v`` columns: rank r gets v // world (+1 for the first ones)."""
    base, extra = divmod(v, world)
    bounds = [0]
    for r in range(world):
        bounds.append(bounds[-1] + base + (1 if r < extra else 0))
    return bounds


def _vocab_parallel(
    ctx: Context, dtype: torch.dtype, backend: str, bound: float, grad_bound: float
) -> Dict[str, Any]:
    from nemo_d3s.core.entropy import entropy_and_logprobs
    from nemo_d3s.distributed.vocab_parallel import vocab_parallel_entropy_and_logprobs

    group = _group(ctx, backend) if ctx.world > 1 else None
    device = ctx.device if backend == "nccl" else torch.device("cpu")
    B, S, V, pad = 3, 16, 1003, 21
    g = torch.Generator().manual_seed(7)
    logits = (4 * torch.randn(B, S, V + pad, generator=g)).to(dtype)  # same on every rank
    targets = torch.randint(0, V, (B, S), generator=g)
    # single-process fp32 reference on the real vocabulary
    ref_in = logits.float()[..., :V].clone().requires_grad_(True)
    ref_ent, ref_lp = entropy_and_logprobs(ref_in, targets)
    ref_lp.sum().backward()
    bounds = _shard_bounds(V + pad, ctx.world)
    lo, hi = bounds[ctx.rank], bounds[ctx.rank + 1]
    local = logits[..., lo:hi].to(device).clone().requires_grad_(True)
    ent, lp = vocab_parallel_entropy_and_logprobs(
        local, targets.to(device), group, vocab_size=V, chunk_size=16
    )
    lp.sum().backward()
    ref_grad = torch.zeros(B, S, V + pad)
    ref_grad[..., :V] = ref_in.grad
    out: Dict[str, Any] = {
        "ranks": ctx.world,
        "dtype": str(dtype).replace("torch.", ""),
        "vocab": V,
        "padded_vocab": V + pad,
        "shard": hi - lo,
    }
    within("entropy_err", max_abs_diff(ent, ref_ent), bound, out)
    within("logprob_err", max_abs_diff(lp, ref_lp), bound, out)
    # the gradient comes back in the logits' dtype: compared with the reference rounded alike
    within("grad_err", max_abs_diff(local.grad, ref_grad[..., lo:hi].to(dtype)), grad_bound, out)
    return out


def _gloo_across_nodes(ctx: Context) -> Dict[str, Any]:
    import os
    import socket

    from nemo_d3s.distributed.agree import all_gather_texts

    need_world(ctx, 2, "a gloo group across the job's ranks")
    ifname = os.environ.get("GLOO_SOCKET_IFNAME", "")
    try:
        group = _group(ctx, "gloo")
        hosts = all_gather_texts(socket.gethostname(), group)
        total = torch.tensor([float(ctx.rank + 1)])
        dist.all_reduce(total, group=group)
    except RuntimeError as e:
        raise CheckFailed(
            f"a gloo group over the job's ranks did not connect ({e}); GLOO_SOCKET_IFNAME="
            f"{ifname or '(unset)'}: set it to the interface the nodes reach each other on "
            "(slurm/network_env.sh)"
        ) from None
    out = {"ranks": ctx.world, "hosts": len(set(hosts)), "gloo_socket_ifname": ifname}
    out["across_nodes"] = out["hosts"] > 1
    if float(total) != ctx.world * (ctx.world + 1) / 2:
        raise CheckFailed(f"gloo all-reduce SUM of 1..{ctx.world} gave {float(total)}", out)
    return out


CHECKS = [
    Check("collectives.gloo", False, lambda ctx: _collectives(ctx, "gloo")),
    Check("collectives.nccl", True, lambda ctx: _collectives(ctx, "nccl")),
    Check("cluster.gloo_across_nodes", False, _gloo_across_nodes),
    Check(
        "vocab_parallel.fp32_gloo",
        False,
        lambda ctx: _vocab_parallel(ctx, torch.float32, "gloo", 1e-5, 1e-5),
    ),
    Check(
        "vocab_parallel.bf16_nccl",
        True,
        lambda ctx: _vocab_parallel(ctx, torch.bfloat16, "nccl", 1e-3, 8e-3),
    ),
]
