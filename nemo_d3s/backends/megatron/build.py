"""The parts of a ``MegatronBackend`` built from its config, in the order that keeps a bad
input from hanging a job: every check that reads only the config and file headers runs on
every rank before the first collective (``init_groups``), so all ranks raise the same error.

``build_policy`` returns them as one ``PolicyParts``; the backend takes its attributes from it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, List, Optional

import torch

from nemo_d3s.backends.hf.loading import resolve_device
from nemo_d3s.backends.lr import lr_multiplier
from nemo_d3s.backends.megatron import checkpoint as ckpt
from nemo_d3s.backends.megatron import optimizer as optim
from nemo_d3s.backends.megatron.config import MegatronBackendConfig
from nemo_d3s.backends.megatron.model import (
    build_stage,
    transformer_config,
    use_transformer_engine,
    virtual_layouts,
)
from nemo_d3s.backends.megatron.moe import check_moe_config, expert_layout, moe_config_kwargs
from nemo_d3s.backends.megatron.prepare import (
    LRSchedule,
    init_groups,
    load_chunks,
    model_dtype,
    model_folder,
    open_weights,
    seed_model_rng,
    world_size,
)
from nemo_d3s.backends.megatron.routing import RouterTaps
from nemo_d3s.distributed.groups import ParallelGroups
from nemo_d3s.formats.spec import ModelSpec, check_layout, padded_vocab_size
from nemo_d3s.formats.weights import Layout

__all__ = ["PolicyParts", "build_policy", "build_chunks", "build_reference"]

log = logging.getLogger("nemo_d3s.megatron")


@dataclass
class PolicyParts:
    """What ``build_policy`` made for this rank.

    ``model`` is this rank's stage (a GPTModel holding ``[*, V/TP]`` output rows on the last
    stage), or the list of its virtual stages' chunks at VPP > 1; ``chunks`` are the same
    modules as the optimizer wraps them (Megatron DDP with the distributed optimizer, else the
    modules themselves); ``ref_model`` is a frozen copy of the initial policy (None without
    ``use_reference``). ``layout`` is this rank's place in the weight table and
    ``stage_layouts`` one per chunk. ``pack``: packed (THD) rows. ``path``: the HF-style folder
    holding the config and tokenizer (a side folder for NeMo 2 / Megatron-LM checkpoints,
    removed with the backend)."""

    device: torch.device
    dtype: torch.dtype
    te: bool
    pack: bool
    path: str
    spec: ModelSpec
    vpp: int
    groups: ParallelGroups
    layout: Layout
    stage_layouts: List[Layout]
    model: Any
    ref_model: Any
    chunks: List[torch.nn.Module]
    optimizer: Any
    router_taps: Optional[RouterTaps]
    scheduler: LRSchedule


def build_policy(
    cfg: MegatronBackendConfig, groups: Optional[ParallelGroups], owner: Any
) -> PolicyParts:
    """Checks, groups (``groups`` when given, else Megatron's built from ``cfg``), the policy's
    chunks loaded from ``cfg``'s checkpoint, the reference, optimizer and LR schedule.
    Collective from ``init_groups`` on. ``owner``'s lifetime bounds a NeMo 2 / Megatron-LM
    checkpoint's side folder."""
    device = resolve_device(cfg.device)
    dtype = model_dtype(cfg, device)
    # On CUDA a Transformer Engine that does not import is an error unless
    # transformer_impl=local: decided here, before any collective, alike on every rank.
    te = use_transformer_engine(cfg.transformer_impl, device)
    # packed (THD) rows: TE's varlen attention on CUDA; on CPU only when asked (the local
    # attention masks a dense [T, T] block-diagonal: local_attention.py)
    pack = te if cfg.pack_sequences is None else bool(cfg.pack_sequences)
    if device.type != "cuda":
        from nemo_d3s.backends.megatron.cpu_compat import apply_cpu_compat

        apply_cpu_compat()
    path = model_folder(cfg)
    spec = ModelSpec.from_folder(path)
    tp, pp = int(cfg.tensor_model_parallel_size), int(cfg.pipeline_model_parallel_size)
    vpp = int(cfg.virtual_pipeline_model_parallel_size or 1)
    ep, etp = cfg.expert_model_parallel_size, cfg.expert_tensor_parallel_size
    cp = int(cfg.context_parallel_size)
    check_layout(
        spec,
        **dict(tp=tp, pp=pp, world=world_size(), vpp=vpp, cp=cp, ep=ep, etp=etp),
        pp_last=not cfg.use_tp_pp_dp_mapping,
    )
    if spec.num_experts and cfg.pack_sequences is None:
        pack = False  # MoE's DP-aligned plans are of rows (moe.align_micro_batches)
    check_moe_config(
        spec,
        cfg,
        packed=pack,
        distributed_optimizer=optim.uses_distributed_optimizer(cfg.distributed_optimizer, device),
    )
    # Checked before any collective (headers only): every rank fails alike.
    reader, path, fmt = open_weights(path, spec, owner)
    if groups is None:
        groups = init_groups(cfg, device, tp, pp, vpp, cp=cp, ep=ep, etp=etp)
    # converted / NeMo 2 checkpoints carry checksums.json
    ckpt.verify_shared(fmt, cfg.verify_checksums)
    from megatron.core import parallel_state as ps

    seed_model_rng(device, cfg.seed)
    layout = Layout(
        tp=tp,
        pp=pp,
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        padded_vocab=padded_vocab_size(spec.vocab_size, tp, cfg.make_vocab_size_divisible_by),
        te=te,
        **expert_layout(spec),
    )
    moe = moe_config_kwargs(
        spec,
        ep=ep,
        etp=etp,
        dispatcher=cfg.moe_token_dispatcher_type,
        router_dtype=cfg.moe_router_dtype,
        grouped_gemm=te,
        aux_loss_coeff=cfg.moe_aux_loss_coeff,
        z_loss_coeff=cfg.moe_z_loss_coeff,
    )
    config = transformer_config(
        spec,
        tp=tp,
        pp=pp,
        params_dtype=dtype,
        device=device,
        recompute=cfg.gradient_checkpointing,
        sequence_parallel=cfg.sequence_parallel,
        vpp=vpp,
        cp=cp,
        moe=moe,
    )
    # One model chunk per virtual stage (interleaved 1F1B), else this rank's stage:
    # ``stage_layouts`` are their layouts in the weight table (model.virtual_layouts).
    stage_layouts = virtual_layouts(layout, vpp)
    chunks = build_chunks(spec, config, layout, stage_layouts, device)
    load_chunks(chunks, stage_layouts, spec, reader)
    model = chunks if vpp > 1 else chunks[0]
    ref_model = None
    if cfg.use_reference:
        ref_model = build_reference(model, spec, config, layout, stage_layouts, device)
    chunks, optimizer = optim.build_optimizer(
        model,
        lr=cfg.lr,
        betas=tuple(cfg.adam_betas),
        eps=cfg.adam_eps,
        weight_decay=cfg.weight_decay,
        grad_clip=cfg.grad_clip,
        distributed_optimizer=cfg.distributed_optimizer,
    )
    # the policy's MoE routers record their routing and replay a given one (routing.py);
    # the reference's keep their own
    router_taps = (
        RouterTaps(chunks, spec.num_layers, spec.moe_topk, spec.num_experts)
        if spec.num_experts
        else None
    )
    if groups.is_main:
        log.info(
            "optimizer: %s",
            "Megatron DDP + distributed optimizer (fp32 main weights and Adam state "
            f"sharded over DP={groups.dp_size})"
            if optim.is_megatron_optimizer(optimizer)
            else "plain AdamW over each rank's shards, gradients all-reduced over DP",
        )
    scheduler = LRSchedule(
        optimizer,
        cfg.lr,
        lr_multiplier(cfg.scheduler, cfg.warmup_steps, cfg.total_steps, cfg.min_lr_ratio),
    )
    return PolicyParts(
        device=device,
        dtype=dtype,
        te=te,
        pack=pack,
        path=path,
        spec=spec,
        vpp=vpp,
        groups=groups,
        layout=layout,
        stage_layouts=stage_layouts,
        model=model,
        ref_model=ref_model,
        chunks=chunks,
        optimizer=optimizer,
        router_taps=router_taps,
        scheduler=scheduler,
    )


def build_chunks(
    spec: ModelSpec,
    config,
    layout: Layout,
    stage_layouts: List[Layout],
    device: torch.device,
) -> List[torch.nn.Module]:
    """This rank's stage, or one chunk per virtual stage (``stage_layouts``); uninitialised
    weights."""
    p, pp, vpp = layout.pp_rank, layout.pp, len(stage_layouts)
    return [
        build_stage(
            spec,
            config,
            lay,
            pre_process=p == 0 and v == 0,
            post_process=p == pp - 1 and v == vpp - 1,
            device=device,
            vp_stage=v if vpp > 1 else None,
        )
        for v, lay in enumerate(stage_layouts)
    ]


def build_reference(
    model,
    spec: ModelSpec,
    config,
    layout: Layout,
    stage_layouts: List[Layout],
    device: torch.device,
):
    """The frozen initial policy for the KL term: rebuilt chunks with ``model``'s parameters
    copied in (megatron-core modules hold ProcessGroups, which deepcopy cannot copy); a list
    when ``model`` is one, like it."""
    refs = build_chunks(spec, config, layout, stage_layouts, device)
    mine = model if isinstance(model, list) else [model]
    with torch.no_grad():
        for ref, chunk in zip(refs, mine):
            params = dict(chunk.named_parameters())
            for name, q in ref.named_parameters():
                q.copy_(params[name])
    refs = [r.eval().requires_grad_(False) for r in refs]
    return refs if isinstance(model, list) else refs[0]
