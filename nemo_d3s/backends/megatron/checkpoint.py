"""The running Megatron policy's state, saved and loaded as sharded checkpoint files
(``formats/shards.py``: the files and the resharding table they are read through).

What the backend adds to the files: which DP rank of each (TP, PP) position writes its
shard (:func:`writer_dp_rank`; of a mixture of experts, which expert-DP rank of each
(EP, ETP, PP) position writes its expert file, :func:`expert_writer`; with a virtual
pipeline each chunk is saved as its virtual stage of a TP x (PP VPP) layout,
:func:`policy_stages`), the optimizer state (plain AdamW's moments, or Megatron's
distributed optimizer's DP-sharded state, and its expert state sharded over expert DP,
gathered to the writer and scattered back on load;
for a bf16 model either optimizer's fp32 main weights, "optim.main.<name>": the plain path's
come from ``main_weights.MainWeightsAdamW``) and the LR-scheduler step. Collective: every
rank calls :func:`save_policy` / :func:`load_policy`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from nemo_d3s.distributed.comm import group_rank

from nemo_d3s.backends.megatron import optimizer as optim
from nemo_d3s.backends.megatron import optimizer_state as ostate
from nemo_d3s.backends.megatron.main_weights import MainWeightsAdamW, adam_state_of, main_weight_of
from nemo_d3s.formats.checksums import check_checksums
from nemo_d3s.formats.detect import LAYOUT_FILE, MEGATRON, MEGATRON_LM, NEMO2, FolderFormat
from nemo_d3s.formats.shards import (
    SUBDIR,
    ShardedReader,
    read_layout,
    file_of,
    read_local_from_checkpoint,
    open_shard,
    read_range_from_checkpoint,
    shard_file,
    shard_metadata,
    write_layout,
)
from nemo_d3s.backends.megatron.moe import ExpertGroups
from nemo_d3s.distributed.comm import group_size
from nemo_d3s.formats.moe import is_expert_param
from nemo_d3s.formats.weights import Layout

__all__ = [
    "policy_stages",
    "policy_tensors",
    "writer_dp_rank",
    "expert_writer",
    "save_policy",
    "load_policy",
    "write_model_files",
    "verify_shared",
]


def policy_stages(pol: Any) -> List[Tuple[torch.nn.Module, Optional[torch.nn.Module], Layout]]:
    """(model chunk, its reference copy or None, its layout) per stage this rank holds: one,
    or one per virtual stage of an interleaved pipeline, whose layout is that stage of a
    TP x (PP VPP) layout (``model.virtual_layouts``): a chunk is saved, loaded and
    resharded as that stage, so a checkpoint written with a virtual pipeline reads back at
    any layout and vice versa."""
    models = pol.model if isinstance(pol.model, (list, tuple)) else [pol.model]
    refs = (
        pol.ref_model if isinstance(pol.ref_model, (list, tuple)) else [pol.ref_model] * len(models)
    )
    layouts = getattr(pol, "stage_layouts", None) or [pol.layout]
    return list(zip(models, refs, layouts))


def policy_tensors(pol: Any, stage: int = 0) -> Dict[str, torch.Tensor]:
    """The backend's (``MegatronBackend``) shard of stage ``stage`` (:func:`policy_stages`)
    on this rank: parameters, plain-AdamW moments, reference, under local names. Megatron's
    distributed optimizer keeps its state sharded over DP: :func:`save_policy` gathers it."""
    model, ref, _ = policy_stages(pol)[stage]
    out: Dict[str, torch.Tensor] = {}
    plain = not optim.is_megatron_optimizer(pol.optimizer)
    for name, p in model.named_parameters():
        out[name] = p.detach()
        st = adam_state_of(pol.optimizer, p) if plain else {}
        for k in ostate.MOMENTS:
            if k in st:
                out[f"optim.{k}.{name}"] = st[k]
        main = main_weight_of(pol.optimizer, p) if plain else None
        if main is not None:  # the plain path's fp32 main weights (bf16 / fp16 model)
            out[f"optim.main.{name}"] = main.detach()
    if ref is not None:
        for name, p in ref.named_parameters():
            out[f"ref.{name}"] = p.detach()
    return out


def writer_dp_rank(layout: Layout, dp_size: int) -> int:
    """The DP rank that writes the shard of ``layout``'s (TP, PP) position: rotated over the
    positions so the writers (each receiving its stage's gathered optimizer state and
    writing its file) spread over the DP replicas' nodes instead of all sitting in replica 0."""
    return (layout.tp_rank + layout.tp * layout.pp_rank) % dp_size


def save_policy(pol: Any, folder: str) -> List[str]:
    """Collective. One DP rank of each (TP, PP) position (:func:`writer_dp_rank`; its CP
    rank 0) writes its shard file (with Megatron's distributed optimizer, after gathering
    the optimizer state's DP (x CP) ranges to it), one expert-DP rank of each (EP, ETP, PP)
    position its expert file (:func:`expert_writer`; the experts' optimizer state gathered
    over the expert-DP group to it); global rank 0 writes layout.json.
    Returns the files this rank wrote (relative to ``folder``: each rank hashes its own). The
    trainer adds atomicity and checksums. A write that fails (OSError: a full disk) is raised
    once this rank has served every collective of the save: the others are in them, and the
    trainer then agrees on the outcome (a writer that stopped mid-gather hung the job)."""
    root = Path(folder) / SUBDIR
    stages = policy_stages(pol)
    wrote: List[str] = []
    errors: List[OSError] = []
    if pol.groups.is_main:
        try:
            root.mkdir(parents=True, exist_ok=True)
            write_layout(root, pol.spec, stages[0][2].at(0, 0))  # a virtual pipeline: TP x (PP VPP)
            wrote.append(f"{SUBDIR}/{LAYOUT_FILE}")
        except OSError as e:
            errors.append(e)
    pol.groups.barrier()
    megatron_opt = optim.is_megatron_optimizer(pol.optimizer)
    # fp32 main weights ARE the parameters at fp32; else both optimizers keep their own
    with_main = (
        megatron_opt or isinstance(pol.optimizer, MainWeightsAdamW)
    ) and pol.dtype != torch.float32
    step = (
        ostate.agreed_step(pol.optimizer, pol.groups.dp)
        if megatron_opt
        else ostate.optimizer_step(pol.optimizer)
    )
    # CP ranks hold the same shards: the writer is CP rank 0 of its DP rank; the distributed
    # optimizer shards over DP x CP (Megatron's DP-CP group, CP varying fastest in it)
    cp = pol.groups.cp_size
    shards = pol.groups.dp
    if cp > 1:
        from megatron.core import parallel_state as ps

        shards = ps.get_data_parallel_group(with_context_parallel=True)
    first_cp = group_rank(pol.groups.cp) == 0
    for i, (model, _, layout) in enumerate(stages):
        meta = {
            "optimizer_step": str(step),
            "scheduler_step": str(pol.scheduler.step_count),
            "main_params": str(int(with_main and (step > 0 or not megatron_opt))),
        }
        own = policy_tensors(pol, i)
        params = list(model.named_parameters())
        if pol.spec.num_experts:
            # first every rank's expert gathers (over its expert-DP group), then the dense
            # ones (over DP x CP): one order on every rank, so no group waits on another
            experts = {k: v for k, v in own.items() if is_expert_param(k)}
            expert_params = [(n, p) for n, p in params if is_expert_param(n)]
            params = [(n, p) for n, p in params if not is_expert_param(n)]
            edp, writes = ExpertGroups.current().edp, expert_writer(layout)
            planned, gathered = _optimizer_states(
                pol, expert_params, edp, expert_writer_rank(layout), with_main, step, megatron_opt
            )
            if writes:
                name = _write_or_serve(errors, root, layout, experts, meta, planned, gathered)
                wrote += [f"{SUBDIR}/{name}"] if name else []
            else:
                for _ in gathered:  # this rank's part of each reduce
                    pass
        writer = writer_dp_rank(layout, pol.groups.dp_size)
        planned, gathered = _optimizer_states(
            pol, params, shards, writer * cp, with_main, step, megatron_opt
        )
        if pol.groups.dp_rank != writer or not first_cp:
            for _ in gathered:  # this rank's part of each reduce
                pass
            continue
        dense = {k: v for k, v in own.items() if not is_expert_param(k)}
        name = _write_or_serve(errors, root, layout, dense, meta, planned, gathered)
        wrote += [f"{SUBDIR}/{name}"] if name else []
    if errors:
        raise errors[0]
    return wrote


def _write_or_serve(
    errors: List[OSError], root: Path, layout: Layout, own, meta, planned, gathered
):
    """:func:`_write_streamed`'s file name, or None after an OSError, kept in ``errors``, once
    the rest of ``gathered`` is consumed: each item is a reduce the other ranks are in."""
    rest = iter(gathered)
    try:
        return _write_streamed(root, layout, own, meta, planned, rest)
    except OSError as e:
        errors.append(e)
        for _ in rest:
            pass
        return None


def _optimizer_states(
    pol: Any,
    params: List[Tuple[str, torch.nn.Parameter]],
    group: Optional[Any],
    dst: int,
    with_main: bool,
    step: int,
    megatron_opt: bool,
) -> Tuple[List[Tuple[str, Tuple[int, ...], torch.dtype]], Iterable]:
    """(what the file announces, the gathered tensors) of the distributed optimizer's state
    of ``params``, sharded over ``group`` and gathered to its rank ``dst``; nothing for the
    plain AdamW (its moments are in ``policy_tensors``). The gather is lazy: a collective
    over ``group`` per tensor as it is consumed."""
    if not megatron_opt:
        return [], iter(())
    planned = ostate.gathered_entries(params, with_main=with_main, step=step)
    gathered = ostate.iter_gathered_states(
        pol.optimizer, params, group, with_main=with_main, step=step, dst=dst
    )
    return planned, gathered


def _write_streamed(
    root: Path,
    layout: Layout,
    own: Dict[str, torch.Tensor],
    meta: Dict[str, str],
    planned: Sequence[Tuple[str, Tuple[int, ...], torch.dtype]] = (),
    gathered: Iterable[Tuple[str, Optional[torch.Tensor]]] = (),
) -> str:
    """Write ``own`` then ``gathered`` (announced by ``planned``) to the shard file of
    ``own``'s tensors (dense or expert) at ``layout``; returns its name. Streamed, tensor by
    tensor: the writer never holds its stage's state in host memory (70B at TP 4 x PP 4: 4.5B
    parameters x (2 + 12) bytes = 64 GB per shard)."""
    name = file_of(next(iter(own)), layout)
    entries = [(k, tuple(v.shape), v.dtype) for k, v in own.items()] + list(planned)
    with open_shard(root, layout, entries, meta, file=name) as f:
        for k, v in own.items():
            f.write(k, v)
        for k, v in gathered:
            f.write(k, v)
    return name


def expert_writer_rank(layout: Layout) -> int:
    """The expert-data-parallel rank that writes the expert file of ``layout``'s (EP, ETP, PP)
    position (receiving its gathered optimizer state), rotated over the positions as the
    dense writers are (:func:`writer_dp_rank`)."""
    size = group_size(ExpertGroups.current().edp)
    return (layout.etp_rank + layout.etp * (layout.ep_rank + layout.ep * layout.pp_rank)) % size


def expert_writer(layout: Layout) -> bool:
    """Whether this rank writes the expert file of its (EP, ETP, PP) position (one
    expert-data-parallel rank per position, whatever its CP rank: EP is carved out of
    DP x CP, so another CP rank may hold other experts)."""
    return group_rank(ExpertGroups.current().edp) == expert_writer_rank(layout)


@torch.no_grad()
def load_policy(pol: Any, folder: str) -> None:
    """Load a checkpoint written at any TP x PP layout (same model) with either optimizer:
    parameters, Adam moments (and the distributed optimizer's fp32 main weights) and step,
    LR-scheduler step, reference. Every tensor is read and checked before the first one is
    copied in, so a bad checkpoint changes nothing."""
    root = Path(folder) / SUBDIR
    saved = read_layout(root, pol.spec)
    meta = shard_metadata(root, saved.at(0, 0)) or {}
    try:
        opt_step, sched_step = int(meta["optimizer_step"]), int(meta["scheduler_step"])
    except (KeyError, ValueError):
        raise ValueError(
            f"{str(root / shard_file(0, 0))!r}: no optimizer/scheduler step in its metadata"
        ) from None
    megatron_opt = optim.is_megatron_optimizer(pol.optimizer)
    main_weights = isinstance(pol.optimizer, MainWeightsAdamW)
    with_main = (megatron_opt or main_weights) and meta.get("main_params") == "1"
    families = ["", *(f"optim.{k}." for k in ostate.MOMENTS), "ref."] + (
        ["optim.main."] if with_main else []
    )
    readers = {prefix: ShardedReader(root, pol.spec, saved, prefix) for prefix in families}

    def read(
        prefix: str, name: str, like: torch.Tensor, dtype: Optional[torch.dtype] = None
    ) -> torch.Tensor:
        t = read_local_from_checkpoint(name, pol.spec, layout, readers[prefix], dtype or like.dtype)
        if t.shape != like.shape:
            raise ValueError(
                f"{prefix}{name}: checkpoint shape {tuple(t.shape)} != model {tuple(like.shape)}"
            )
        return t

    # Megatron's distributed optimizer keeps fp32 moments and main weights whatever the
    # model's dtype, and only this DP rank's range of each (local_ranges): only that range is
    # read (the rows holding it, at the saved layout) and kept (on the CPU; scatter_states
    # moves it), so each DP rank reads and stages 1/DP of the stage's optimizer state.
    # The plain AdamW keeps full moments in the parameter's dtype, or in fp32 with fp32 main
    # weights (MainWeightsAdamW: a bf16 / fp16 model).
    ranges = ostate.local_ranges(pol.optimizer) if megatron_opt else {}
    staged: List[Tuple[torch.Tensor, torch.Tensor]] = []
    # per stage: {local name: moments}; names repeat across the chunks of a virtual pipeline
    moments: List[Dict[str, Dict[str, torch.Tensor]]] = []
    stages = policy_stages(pol)
    for model, ref, layout in stages:  # (``read`` reads at ``layout``)
        mom: Dict[str, Dict[str, torch.Tensor]] = {}
        moments.append(mom)
        for name, p in model.named_parameters():
            t = read("", name, p)
            staged.append((p, t))
            if megatron_opt:
                if p not in ranges:
                    continue
                a, b = ranges[p]

                def share(prefix: str) -> torch.Tensor:
                    return read_range_from_checkpoint(
                        name, pol.spec, layout, readers[prefix], torch.float32, p.shape, a, b
                    )

                cut = {k: share(f"optim.{k}.") for k in ostate.MOMENTS} if opt_step > 0 else {}
                cut["main"] = (
                    share("optim.main.")
                    if with_main and opt_step > 0
                    else t.float().reshape(-1)[a:b].clone()
                )
                mom[name] = cut
            elif main_weights and main_weight_of(pol.optimizer, p) is not None:
                main = (
                    read("optim.main.", name, p, torch.float32)
                    if with_main and opt_step > 0
                    else t.float()
                )
                cut = (
                    {k: read(f"optim.{k}.", name, p, torch.float32) for k in ostate.MOMENTS}
                    if opt_step > 0
                    else {}
                )
                mom[name] = {**cut, "main": main}
            elif opt_step > 0:
                mom[name] = {k: read(f"optim.{k}.", name, p) for k in ostate.MOMENTS}
        if ref is not None:
            for name, p in ref.named_parameters():
                staged.append((p, read("ref.", name, p)))
    for p, t in staged:
        p.copy_(t.to(p.device))
    for (model, _, _), mom in zip(stages, moments):
        if megatron_opt:
            ostate.scatter_states(pol.optimizer, model.named_parameters(), mom, opt_step)
            continue
        for name, p in model.named_parameters():
            if name not in mom:
                continue
            state = {k: v.to(p.device) for k, v in mom[name].items()}
            key = p
            if "main" in state:
                key = pol.optimizer.main_of(p)
                key.copy_(state.pop("main"))
            if state:
                pol.optimizer.state[key] = {"step": torch.tensor(float(opt_step)), **state}
    pol.scheduler.set_step(sched_step)


def write_model_files(pol: Any, folder: Path) -> None:
    """config.json (with the parameters' dtype), generation config and tokenizer of the
    policy ``pol``: what an HF export holds besides the weights, and what a training
    checkpoint keeps so that it describes itself (``nemo-d3s-convert megatron-to-hf``
    needs no --hf-config). Global rank 0 calls it."""
    cfg = json.loads(Path(pol.path, "config.json").read_text())
    cfg["torch_dtype" if "torch_dtype" in cfg else "dtype"] = str(pol.dtype).replace("torch.", "")
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    if Path(pol.path, "generation_config.json").is_file():
        shutil.copyfile(Path(pol.path, "generation_config.json"), folder / "generation_config.json")
    pol.tokenizer.save_pretrained(str(folder))


def verify_shared(fmt: FolderFormat, verify: bool = True) -> None:
    """Collective over the whole job: check the checksums.json of the Megatron or NeMo 2
    checkpoint ``fmt`` (``formats.detect_format``) before the model is built; nothing to do
    for another kind, without the file or when not ``verify``
    (``model.params.verify_checksums``). ``formats.checksums.check_checksums``: every rank
    reads its share, the findings are all-gathered, every rank raises the same ConfigError."""
    import torch.distributed as dist

    from nemo_d3s.distributed.agree import all_gather_texts

    if not verify or fmt.kind not in (MEGATRON, NEMO2, MEGATRON_LM):
        return
    # without the file: formats.checksums.missing_checksums (the same verdict on every rank)
    shared = dist.is_available() and dist.is_initialized()
    check_checksums(
        fmt.folder,
        skip_hint="set model.params.verify_checksums=false",
        rank=dist.get_rank() if shared else 0,
        world=dist.get_world_size() if shared else 1,
        gather=(lambda s: all_gather_texts(s, dist.group.WORLD)) if shared else None,
    )
