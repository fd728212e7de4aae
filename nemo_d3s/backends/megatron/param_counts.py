"""Parameter counts of one Megatron (TP rank, PP stage) position, for the dry run
(``nemo_d3s/dry_run/plan.py``): from the weight table (``formats.weights.local_shape``), as this
position's share of the HF model, and by building the stage with megatron-core on the meta device
under a fake process group of the job's world size (no memory, no weights, no collectives)."""

from __future__ import annotations

import contextlib
import math
from dataclasses import replace
from typing import Any, Dict, Iterator, List, Optional, Tuple

from nemo_d3s.formats.moe import is_expert_param

from nemo_d3s.backends.megatron.parallel import (
    DEFAULT_ORDER,
    first_ranks_of_model_copies,
    global_rank_of,
)

__all__ = [
    "expert_real_param_count",
    "stage_positions",
    "local_param_count",
    "real_param_count",
    "meta_param_counts",
]


def stage_positions(tp: int, pp: int) -> List[Tuple[int, int]]:
    """Every (tp_rank, pp_rank) of a TP x PP layout, stage by stage."""
    return [(t, p) for p in range(pp) for t in range(tp)]


def local_param_count(spec, layout, experts: Optional[bool] = None) -> int:
    """Parameters of one position's stage (vocabulary padding included), from the table;
    ``experts`` True / False: only the expert / the dense ones (``moe.is_expert_param``)."""
    from nemo_d3s.formats.weights import local_names, local_shape

    return sum(
        math.prod(local_shape(n, spec, layout))
        for n in local_names(spec, layout)
        if experts is None or is_expert_param(n) == experts
    )


def expert_real_param_count(spec, layout) -> int:
    """The expert parameters of the HF model on the whole EP x ETP x PP grid of ``layout``
    (each expert shard once): with the dense positions' real counts, ``spec.num_params``."""
    return sum(
        local_param_count(spec, layout.at(0, p, ep_rank=e, etp_rank=t), experts=True)
        for p in range(layout.pp)
        for e in range(layout.ep)
        for t in range(layout.etp)
    )


def real_param_count(spec, layout) -> int:
    """This position's share of the HF model: padding rows dropped, the tied output layer
    (the last stage's copy of the embedding) and TP-replicated tensors (norms) on TP ranks
    > 0 not counted, experts not counted (:func:`expert_real_param_count`); summed over all
    positions this is ``spec.num_params`` less the experts."""
    from nemo_d3s.formats.weights import hf_shape, local_names, local_parts, local_shape

    total = 0
    for name in local_names(spec, layout):
        if name == "output_layer.weight" and spec.tie_word_embeddings:
            continue
        if is_expert_param(name):
            continue  # counted over the expert grid: expert_real_param_count
        dim, parts = local_parts(name, spec, layout)
        whole = (
            len(parts) == 1
            and parts[0].hf_name
            and parts[0].lo == 0
            and parts[0].rows == hf_shape(parts[0].hf_name, spec)[dim]
        )
        if (
            whole
            and layout.tp_rank > 0
            and not name.endswith(("word_embeddings.weight", "output_layer.weight"))
        ):
            continue
        shape = list(local_shape(name, spec, layout))
        shape[dim] = sum(p.rows for p in parts if p.hf_name is not None)
        total += math.prod(shape)
    return total


@contextlib.contextmanager
def _fake_world(
    rank: int, world: int, tp: int, pp: int, order: str, ep: int = 1, etp: Optional[int] = None
) -> Iterator[Any]:
    """Megatron's parallel state of global ``rank`` in a ``world``-rank job, in this one
    process: torch's fake process-group backend (collectives are no-ops) under megatron's
    ``initialize_model_parallel`` (no gloo side groups). Torn down on exit."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    # torch's only fake process group (no public home); guarded below where it may be absent
    from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: PLC2701

    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            create_gloo_process_groups=False,
            order=order,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=etp,
        )
        try:
            yield ps
        finally:
            ps.destroy_model_parallel()
    finally:
        dist.destroy_process_group()


def meta_param_counts(
    spec,
    *,
    tp: int,
    pp: int,
    world: int,
    padded_vocab: int,
    order: str = DEFAULT_ORDER,
    ep: int = 1,
    etp: Optional[int] = None,
) -> Dict[str, Any]:
    """Build each distinct position's GPTModel stage on the meta device under a fake
    process group of ``world`` ranks and count its parameters. Returns {"counts":
    {"tp_rank,pp_rank": n}, "engine_sources": [...]} or {"skipped": reason}."""
    import warnings

    import torch
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return {"skipped": "a process group already exists in this process"}
    try:
        from torch.testing._internal.distributed import fake_pg  # noqa: F401, PLC2701
    except Exception as e:  # an internal torch module: absent from some builds
        return {"skipped": f"torch's fake process group is not available ({type(e).__name__}: {e})"}
    from nemo_d3s.backends.megatron.model import build_stage, transformer_config
    from nemo_d3s.backends.megatron.moe import expert_layout, moe_config_kwargs
    from nemo_d3s.formats.weights import Layout

    dp = world // (tp * pp)
    kinds = {}
    for p in range(pp):
        kinds.setdefault((p == 0, p == pp - 1), p)
    wanted = [(0, p) for p in kinds.values()] + ([(tp - 1, 0)] if tp > 1 else [])
    counts: Dict[str, int] = {}
    meta = torch.device("meta")
    cuda = torch.Tensor.cuda
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for t, p in wanted:
            rank = global_rank_of(t, p, 0, tp=tp, pp=pp, dp=dp, order=order)  # DP replica 0
            with _fake_world(rank, world, tp, pp, order, ep, etp) as ps:
                got = (ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank())
                if got != (t, p):
                    raise RuntimeError(
                        f"megatron placed global rank {rank} at (TP, PP) = {got}, expected "
                        f"{(t, p)}: its rank order is not {order}"
                    )
                layout = Layout(
                    tp=tp, pp=pp, tp_rank=t, pp_rank=p, padded_vocab=padded_vocab, te=False
                )
                layout = replace(layout, **expert_layout(spec))
                # the allgather dispatcher: the parameters are the same, and the all-to-all
                # one builds a CUDA stream at construction (no CUDA here)
                moe = moe_config_kwargs(
                    spec,
                    ep=ep,
                    etp=etp,
                    dispatcher="allgather",
                    router_dtype="fp32",
                    grouped_gemm=False,
                )
                config = transformer_config(
                    spec, tp=tp, pp=pp, params_dtype=torch.bfloat16, device=meta, moe=moe
                )
                # Tied embeddings at PP > 1: megatron moves the last stage's copy with
                # Tensor.cuda() before its all-reduce; on meta tensors that is the identity.
                torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]
                try:
                    with meta:
                        model = build_stage(
                            spec,
                            config,
                            layout,
                            pre_process=ps.is_pipeline_first_stage(),
                            post_process=ps.is_pipeline_last_stage(),
                            device=meta,
                        )
                finally:
                    torch.Tensor.cuda = cuda  # type: ignore[method-assign]
                counts[f"{t},{p}"] = sum(x.numel() for x in model.parameters())
                del model
        # Where the rollout engines start: the first rank of the last DP replica's TP x PP group.
        last = first_ranks_of_model_copies(tp, pp, dp, order)[-1]
        with _fake_world(last, world, tp, pp, order, ep, etp) as ps:
            first = dist.get_global_rank(ps.get_model_parallel_group(), 0)
            if first != last:
                raise RuntimeError(
                    f"the TP x PP group of rank {last} starts at rank {first}: megatron's "
                    f"rank order is not {order}"
                )
    return {"counts": counts, "built": sorted(counts)}
