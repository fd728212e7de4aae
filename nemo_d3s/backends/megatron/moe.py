"""Mixture-of-experts in the Megatron backend: megatron-core's ``MoELayer`` configured from a
:class:`ModelSpec`, its expert process groups, and the experts' share of the weight stream.

- :func:`moe_config_kwargs`: the ``TransformerConfig`` MoE fields (router top-k with the
  architecture's softmax scoring, dropless: no capacity factor, the dispatcher, EP / ETP;
  grouped GEMM with the Transformer Engine spec, ``SequentialMLP`` with the local one).
- :class:`ExpertGroups`: EP, expert-TP and expert-data-parallel groups of this rank
  (``megatron.core.parallel_state``), None where a dimension is 1.
- :func:`iter_expert_hf`: one expert parameter of a stage as its HF tensors for every EP
  rank, on every rank of the EP group (all-gather over ETP, one broadcast per HF tensor
  over EP, then over PP): what ``model.iter_hf_weights`` yields for an expert parameter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from nemo_d3s.backends.megatron.batches import MicroBatch
from nemo_d3s.distributed.groups import ParallelGroups
from nemo_d3s.errors import ConfigError
from nemo_d3s.distributed.comm import global_rank_of, group_rank, group_size, is_single
from nemo_d3s.formats.moe import check_megatron_router, moe_transformer_fields
from nemo_d3s.formats.spec import ModelSpec
from nemo_d3s.formats.weights import Layout, assemble_hf, hf_shape, iter_stage_hf

__all__ = [
    "ExpertGroups",
    "align_micro_batches",
    "couples_data_parallel",
    "check_moe_config",
    "check_moe_layout",
    "expert_layout",
    "iter_expert_hf",
    "moe_config_kwargs",
    "router_loss_metrics",
]


def check_moe_layout(
    spec: ModelSpec,
    *,
    tp: int,
    sequence_parallel: bool,
    packed: bool = False,
    ep: int = 1,
    etp: Optional[int] = None,
    distributed_optimizer: bool = False,
) -> None:
    """What megatron-core's MoE layer refuses only in its first training forward, refused
    before start: tensor parallelism without sequence parallelism (0.16.1
    transformer/moe/moe_layer.py:379-383; its dispatchers take [S/TP, b, H] inputs). And
    what this backend does not do yet for experts: packed sequences (``align_micro_batches``
    pads and widens rows, not packs). Experts with context parallelism are allowed: EP is
    carved out of DP x CP as in megatron-core, each CP rank's tokens go to their experts'
    ranks. So is Megatron's distributed optimizer: megatron-core shards the expert state over
    the expert-data-parallel group (the expert optimizer of ``get_megatron_optimizer``), and
    ``checkpoint.save_policy`` gathers it over that group, except at EP 1 with an expert width
    ETP (None: TP) other than TP, refused with it: megatron-core marks expert weights
    ``allreduce`` (dense) unless EP > 1 (0.16.1 ``tensor_parallel/layers.py:829,886``,
    ``transformer/moe/experts.py:89,203-204``), so its DDP reduces them over DP x CP
    (``distributed/distributed_data_parallel.py:122``) and its optimizer shards them there
    (``optimizer/__init__.py:165``), not over the expert-data-parallel group: TP 2 with ETP 1
    lets the TP ranks' expert copies drift apart; ETP 2 over TP 1 averages different shards."""
    check_megatron_router(spec)
    etp = tp if etp is None else etp
    if spec.num_experts and distributed_optimizer and ep == 1 and etp != tp:
        raise ConfigError(
            f"{spec.architecture} (mixture of experts) at expert_model_parallel_size=1 with "
            f"expert_tensor_parallel_size={etp} != tensor_model_parallel_size={tp} and the "
            "distributed optimizer: megatron-core then reduces and shards the experts as dense "
            "weights, over the wrong ranks; set model.params.expert_tensor_parallel_size to "
            f"{tp}, expert_model_parallel_size > 1, or model.params.distributed_optimizer=false"
        )
    if spec.num_experts and packed:
        raise ConfigError(
            f"{spec.architecture} (mixture of experts) with trainer.pack_sequences=true: "
            "expert layers' micro-batch plans are of padded rows; set "
            "trainer.pack_sequences=false"
        )
    if spec.num_experts and tp > 1 and not sequence_parallel:
        raise ConfigError(
            f"{spec.architecture} (mixture of experts) at tensor_model_parallel_size={tp} "
            "needs model.params.sequence_parallel=true (megatron-core's MoE layer trains "
            "only on sequence-parallel inputs)"
        )


def check_moe_config(spec: ModelSpec, cfg, *, packed: bool, distributed_optimizer: bool) -> None:
    """:func:`check_moe_layout` for the backend config ``cfg`` (its TP, sequence parallelism,
    EP and ETP): the backend's start-up and the dry run's plan both call it."""
    check_moe_layout(
        spec,
        tp=int(cfg.tensor_model_parallel_size),
        sequence_parallel=bool(cfg.sequence_parallel),
        packed=packed,
        ep=int(cfg.expert_model_parallel_size),
        etp=cfg.expert_tensor_parallel_size,
        distributed_optimizer=distributed_optimizer,
    )


def moe_config_kwargs(
    spec: ModelSpec,
    *,
    ep: int,
    etp: Optional[int],
    dispatcher: str,
    router_dtype: Optional[str],
    grouped_gemm: bool,
    aux_loss_coeff: float = 0.0,
    z_loss_coeff: float = 0.0,
) -> Dict[str, object]:
    """``TransformerConfig`` keyword arguments of ``spec``'s MoE layers ({} when dense).

    Dropless (``moe_expert_capacity_factor=None``): every token reaches its k experts, so
    a token's experts depend on that token's hidden state alone (what D3S's compaction
    relies on). Router losses only when their coefficients are > 0: megatron-core's
    per-micro-batch load-balancing loss (``"aux_loss"``) and z loss over the real tokens,
    averaged over the step's micro-batches that hold one (``router_losses``)."""
    if not spec.num_experts:
        return {}
    return dict(
        moe_router_load_balancing_type="aux_loss" if aux_loss_coeff > 0 else "none",
        moe_aux_loss_coeff=float(aux_loss_coeff),
        moe_z_loss_coeff=float(z_loss_coeff) if z_loss_coeff > 0 else None,
        **moe_transformer_fields(spec),
        moe_router_dtype=router_dtype,
        moe_token_dispatcher_type=dispatcher,
        moe_expert_capacity_factor=None,
        moe_grouped_gemm=grouped_gemm,
        moe_permute_fusion=False,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
    )


@dataclass(frozen=True)
class ExpertGroups:
    """This rank's expert groups: ``ep`` (ranks holding other experts), ``etp`` (ranks
    splitting the same experts), ``edp`` (ranks holding the same expert shards: their
    gradients are reduced over it), ``emp`` (ETP x EP x PP: one copy of every expert
    shard, where the expert part of the gradient norm is summed). None = one member."""

    ep: Optional[dist.ProcessGroup] = None
    etp: Optional[dist.ProcessGroup] = None
    edp: Optional[dist.ProcessGroup] = None
    emp: Optional[dist.ProcessGroup] = None

    @classmethod
    def current(cls) -> "ExpertGroups":
        """From ``megatron.core.parallel_state`` (after ``initialize_model_parallel``)."""
        from megatron.core import parallel_state as ps

        def single(g):
            return None if is_single(g) else g

        return cls(
            ep=single(ps.get_expert_model_parallel_group()),
            etp=single(ps.get_expert_tensor_parallel_group()),
            edp=single(ps.get_expert_data_parallel_group()),
            emp=single(ps.get_expert_tensor_model_pipeline_parallel_group()),
        )

    @property
    def ep_rank(self) -> int:
        return group_rank(self.ep)

    @property
    def etp_rank(self) -> int:
        return group_rank(self.etp)


def couples_data_parallel(chunks: List[torch.nn.Module], groups: ParallelGroups) -> bool:
    """Whether the model's forward is a collective over ``groups.dp``: MoE layers at DP > 1
    (EP and ETP are carved out of DP), so a rank with no rows still runs every forward."""
    from megatron.core.utils import get_model_config

    if groups.dp_size == 1:  # nothing to couple; the model need not carry a Megatron config
        return False
    return bool(getattr(get_model_config(chunks[0]), "num_moe_experts", None))


def align_micro_batches(mbs: List[MicroBatch], groups: ParallelGroups, config) -> List[MicroBatch]:
    """The plan of a mixture-of-experts model, made the same across the DP group: every MoE
    layer's dispatch is a collective over ranks that hold other samples (EP, and ETP where it
    differs from TP, are carved out of DP), so every rank runs as many micro-batches as the
    one with the most (zero-weight ones appended, of the first one's shape); with the
    ``allgather`` dispatcher, whose gather takes equal token counts from every rank
    (0.16.1 transformer/moe/token_dispatcher.py:255-277), every micro-batch also gets the
    largest rows x width over the group. Unchanged for a dense model or at DP 1. One
    all-reduce (MAX) of 3 integers over ``groups.dp``."""
    if not getattr(config, "num_moe_experts", None) or groups.dp_size == 1:
        return mbs
    mine = [len(mbs), max(m.b for m in mbs), max(m.width for m in mbs)]
    most = torch.tensor(mine, dtype=torch.long, device=groups.device)
    dist.all_reduce(most, op=dist.ReduceOp.MAX, group=groups.dp)
    n, b, width = (int(v) for v in most.cpu())
    if config.moe_token_dispatcher_type == "allgather":
        mbs = [MicroBatch(m.rows, b, width) for m in mbs]
    pad = MicroBatch(torch.zeros(0, dtype=torch.long), mbs[0].b, mbs[0].width)
    return mbs + [pad] * (n - len(mbs))


def expert_layout(spec: ModelSpec) -> Dict[str, int]:
    """This rank's ``Layout`` expert fields (ep, ep_rank, etp, etp_rank) from
    ``parallel_state``; {} for a dense model (the defaults: one rank of each)."""
    if not spec.num_experts:
        return {}
    from megatron.core import parallel_state as ps

    return dict(
        ep=ps.get_expert_model_parallel_world_size(),
        ep_rank=ps.get_expert_model_parallel_rank(),
        etp=ps.get_expert_tensor_parallel_world_size(),
        etp_rank=ps.get_expert_tensor_parallel_rank(),
    )


@torch.no_grad()
def iter_expert_hf(
    local: str,
    param: Optional[torch.Tensor],
    spec: ModelSpec,
    stage: Layout,
    groups: ExpertGroups,
    pp: Optional[dist.ProcessGroup],
    owner: int,
    *,
    device: torch.device,
    dtype: torch.dtype,
) -> Iterator[Tuple[str, torch.Tensor]]:
    """(HF name, full tensor) of expert parameter ``local`` of stage ``stage`` for every EP
    rank's expert, on every rank of the EP x PP group (collective). ``param``: this rank's
    tensor when its pipeline rank is ``owner`` (the stage's), else None. Per EP rank s, in
    order: its [2 F'/ETP, H] or [H, F'/ETP] shards all-gathered over ETP (by every EP rank
    at once), assembled, then each HF tensor broadcast from s over EP and from ``owner``
    over ``pp``. Memory: one expert's ETP shards and HF tensors at a time."""
    full: Dict[str, torch.Tensor] = {}
    if param is not None:
        t = param.detach().contiguous()
        shards = [t]
        if groups.etp is not None:
            shards = [torch.empty_like(t) for _ in range(group_size(groups.etp))]
            dist.all_gather(shards, t, group=groups.etp)
        full = assemble_hf(local, shards, spec, stage.at(stage.tp_rank, etp_rank=0))
    for s in range(stage.ep):
        _, produced = next(iter_stage_hf([local], spec, stage.at(stage.tp_rank, ep_rank=s)))
        for h in produced:
            mine = param is not None and s == groups.ep_rank
            x = full[h] if mine else torch.empty(hf_shape(h, spec), dtype=dtype, device=device)
            if param is not None and groups.ep is not None:
                dist.broadcast(x, src=global_rank_of(groups.ep, s), group=groups.ep)
            if not is_single(pp):
                dist.broadcast(x, src=global_rank_of(pp, owner), group=pp)
            yield h, x


ROUTER_LOSSES = ("load_balancing_loss", "z_loss")  # megatron-core's tracker names


def router_loss_metrics(
    groups: ParallelGroups, num_layers: int, micro_batches: int
) -> Dict[str, float]:
    """The step's router losses from megatron-core's per-layer tracker (each layer's loss
    over the coefficient in use, summed over this rank's micro-batches: 0.16.1
    transformer/moe/router.py:448-455, :505-507), as ``moe_<name>``: the mean over layers and
    over the step's ``micro_batches`` (those with a real token, over DP:
    ``routing.RouterTaps.loss_micro_batches``; the others compute no loss,
    ``router_losses``), this rank's share of it, so that the trainer's sum over DP ranks is
    the mean. Each TP x CP rank tracks its tokens' part, summed over them (megatron-core's
    own reduction of the load-balancing loss, moe_utils.py:941-942; the z loss's parts as
    ``router_losses.RouterPadding`` weights them). The tracker is cleared. Collective over
    ``groups.pp``, ``groups.tp`` and ``groups.cp``."""
    from megatron.core.transformer.moe.moe_utils import (
        clear_aux_losses_tracker,
        get_moe_layer_wise_logging_tracker,
    )

    tracker = get_moe_layer_wise_logging_tracker()
    out: Dict[str, float] = {}
    for name in ROUTER_LOSSES:
        if name not in tracker:
            continue
        total = tracker[name]["values"].detach().double().sum().reshape(1).to(groups.device)
        for g in (groups.pp, groups.tp, groups.cp):
            if not is_single(g):
                dist.all_reduce(total, group=g)
        out[f"moe_{name}"] = float(total[0]) / (num_layers * max(micro_batches, 1))
    clear_aux_losses_tracker()
    return out
