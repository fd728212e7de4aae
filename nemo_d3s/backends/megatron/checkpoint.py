"""Sharded checkpoints of the Megatron backend: safetensors per (TP, PP) position, loadable
at any other TP x PP layout through the weight table.

Layout of ``<step dir>/megatron/``::

    layout.json                  {"format": 1, "tp", "pp", "padded_vocab", "te", "spec": ModelSpec}
    tp{t:02d}_pp{p:02d}.safetensors   written by one DP rank of that position: the stage's
                                 parameters under Megatron's local names, the Adam moments
                                 as "optim.exp_avg.<name>" / "optim.exp_avg_sq.<name>" (Megatron's
                                 distributed optimizer: gathered over DP, fp32, plus its fp32
                                 main weights "optim.main.<name>" for bf16 models), the
                                 frozen reference as "ref.<name>"; metadata: optimizer step,
                                 LR-scheduler step, main_params (plain strings)

Why not ``megatron.core.dist_checkpointing``: its formats are read back with pickle (the
torch_dist ``.metadata`` file and ``common.pt``), and every file a run reads back here is
untrusted input. safetensors holds tensors and strings only. The trainer's checkpoint
manager adds atomicity (temporary folder + rename) and a SHA-256 per file on top.

Resharding: a rank of another layout rebuilds each of its local tensors from the HF-named
rows it covers (``weights.local_parts``), reading the saved TP shards of the stage that
holds them and reassembling the HF tensor (``weights.assemble_hf``). AdamW's moments have
their parameter's shape, so they reshard the same way: a checkpoint written at TP2 x PP2
resumes at TP1 x PP1 with model AND optimizer state, with either optimizer (plain AdamW or
Megatron's distributed optimizer, whose DP ranges are cut out of the full tensors).
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

from nemo_d3s.backends.megatron import optimizer as optim
from nemo_d3s.backends.megatron.hf_config import ModelSpec
from nemo_d3s.backends.megatron.weights import Layout, assemble_hf, local_names, local_parts, read_local
from nemo_d3s.config import ConfigError

__all__ = ["FORMAT", "shard_file", "write_layout", "read_layout", "ShardedReader", "save_shard", "load_policy",
           "policy_tensors", "save_policy", "writer_dp_rank"]

FORMAT = 1
SUBDIR = "megatron"


def shard_file(tp_rank: int, pp_rank: int) -> str:
    return f"tp{tp_rank:02d}_pp{pp_rank:02d}.safetensors"


def write_layout(folder: Path, spec: ModelSpec, layout: Layout) -> None:
    (folder / "layout.json").write_text(json.dumps({
        "format": FORMAT, "tp": layout.tp, "pp": layout.pp, "padded_vocab": layout.padded_vocab,
        "te": layout.te, "spec": spec.to_dict(),
    }, indent=1))


def read_layout(folder: Path, spec: ModelSpec) -> Layout:
    """The saved layout; ConfigError when the checkpoint is of another model (any field of
    the model shape differs; the dtype may)."""
    path = folder / "layout.json"
    try:
        raw = json.loads(path.read_text())
        saved = raw["spec"]
        if raw.get("format") != FORMAT:
            raise ValueError(f"format {raw.get('format')!r} (this version reads {FORMAT})")
        tp, pp, pv = int(raw["tp"]), int(raw["pp"]), int(raw["padded_vocab"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{str(path)!r}: not a nemo_d3s Megatron checkpoint layout ({e})") from None
    mine = spec.to_dict()
    diff = [k for k in mine if k != "torch_dtype" and saved.get(k) != mine[k]]
    if diff:
        k = diff[0]
        raise ConfigError(
            f"{str(path)!r} is a checkpoint of another model: {k}={saved.get(k)!r} there, {mine[k]!r} here"
        )
    return Layout(tp, pp, 0, 0, pv, bool(raw.get("te", False)))


def save_shard(folder: Path, layout: Layout, tensors: Dict[str, torch.Tensor], metadata: Dict[str, str]) -> None:
    from safetensors.torch import save_file

    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()},
              str(folder / shard_file(layout.tp_rank, layout.pp_rank)), metadata=metadata)


class ShardedReader:
    """HF-named row ranges out of a saved sharded checkpoint (any layout), duck-typing
    ``weights.SafetensorsReader`` so :func:`weights.read_local` builds a local tensor of the
    CURRENT layout from it. ``prefix`` selects the saved family ("" = parameters,
    "optim.exp_avg." = first moments, ...). Files are opened lazily and only the shards of
    the stage that holds a requested tensor are read."""

    def __init__(self, folder: Path, spec: ModelSpec, saved: Layout, prefix: str = "") -> None:
        self.folder, self.spec, self.saved, self.prefix = folder, spec, saved, prefix
        self._where: Dict[str, Tuple[int, str]] = {}
        for stage in range(saved.pp):
            st = saved.at(0, stage)
            for local in local_names(spec, st):
                if local == "output_layer.weight" and spec.tie_word_embeddings:
                    continue
                for part in local_parts(local, spec, st)[1]:
                    if part.hf_name is not None:
                        self._where.setdefault(part.hf_name, (stage, local))
        self._full = lru_cache(maxsize=1)(self._assemble)

    def _tensor(self, tp_rank: int, stage: int, key: str) -> torch.Tensor:
        from safetensors import safe_open

        path = self.folder / shard_file(tp_rank, stage)
        if not path.is_file():
            raise ConfigError(f"{str(path)!r} is missing from the checkpoint")
        with safe_open(str(path), framework="pt") as f:
            if key not in f.keys():
                raise ConfigError(f"{str(path)!r} holds no tensor {key!r}")
            return f.get_tensor(key)

    def _assemble(self, stage: int, local: str) -> Dict[str, torch.Tensor]:
        st = self.saved.at(0, stage)
        shards = [self._tensor(r, stage, self.prefix + local) for r in range(self.saved.tp)]
        return assemble_hf(local, shards, self.spec, st)

    def rows(self, name: str, dim: int, lo: int, hi: int) -> torch.Tensor:
        stage, local = self._where[name]
        return self._full(stage, local)[name].narrow(dim, lo, hi - lo)

    def same_layout_tensor(self, layout: Layout, key: str) -> torch.Tensor:
        return self._tensor(layout.tp_rank, layout.pp_rank, key)


def read_local_from_checkpoint(name: str, spec: ModelSpec, layout: Layout, reader: ShardedReader,
                               dtype: torch.dtype) -> torch.Tensor:
    """Local tensor ``name`` of ``layout`` from the checkpoint: the saved shard itself when
    the layouts agree (bit-exact, padding rows included), else rebuilt through the table."""
    s = reader.saved
    if (s.tp, s.pp, s.padded_vocab, s.te) == (layout.tp, layout.pp, layout.padded_vocab, layout.te):
        return reader.same_layout_tensor(layout, reader.prefix + name).to(dtype)
    return read_local(name, spec, layout, reader, dtype)


def shard_metadata(folder: Path, layout: Layout) -> Optional[Dict[str, str]]:
    from safetensors import safe_open

    path = folder / shard_file(layout.tp_rank, layout.pp_rank)
    if not path.is_file():
        return None
    with safe_open(str(path), framework="pt") as f:
        return f.metadata() or {}


# ---------------------------------------------------------------------------- the backend's state
def policy_stages(pol: Any) -> List[Tuple[torch.nn.Module, Optional[torch.nn.Module], Layout]]:
    """(model chunk, its reference copy or None, its layout) per stage this rank holds: one,
    or one per virtual stage of an interleaved pipeline, whose layout is that stage of a
    TP x (PP VPP) layout (``model.virtual_layouts``): a chunk is saved, loaded and
    resharded as that stage, so a checkpoint written with a virtual pipeline reads back at
    any layout and vice versa."""
    models = pol.model if isinstance(pol.model, (list, tuple)) else [pol.model]
    refs = pol.ref_model if isinstance(pol.ref_model, (list, tuple)) else [pol.ref_model] * len(models)
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
        st = pol.optimizer.state.get(p, {}) if plain else {}
        for k in optim.MOMENTS:
            if k in st:
                out[f"optim.{k}.{name}"] = st[k]
    if ref is not None:
        for name, p in ref.named_parameters():
            out[f"ref.{name}"] = p.detach()
    return out


def writer_dp_rank(layout: Layout, dp_size: int) -> int:
    """The DP rank that writes the shard of ``layout``'s (TP, PP) position: rotated over the
    positions so the writers (which hold the stage's gathered optimizer state in host
    memory) spread over the DP replicas' nodes instead of all sitting in replica 0."""
    return (layout.tp_rank + layout.tp * layout.pp_rank) % dp_size


def save_policy(pol: Any, folder: str) -> None:
    """Collective. One DP rank of each (TP, PP) position (:func:`writer_dp_rank`) writes its
    shard file (with Megatron's distributed optimizer, after gathering the optimizer state's
    DP ranges to it); global rank 0 writes layout.json. The trainer adds atomicity and
    checksums."""
    root = Path(folder) / SUBDIR
    stages = policy_stages(pol)
    if pol.groups.is_main:
        root.mkdir(parents=True, exist_ok=True)
        write_layout(root, pol.spec, stages[0][2].at(0, 0))  # a virtual pipeline: TP x (PP VPP)
    pol.groups.barrier()
    megatron_opt = optim.is_megatron_optimizer(pol.optimizer)
    with_main = megatron_opt and pol.dtype != torch.float32  # fp32 main weights ARE the parameters
    step = optim.agreed_step(pol.optimizer, pol.groups.dp) if megatron_opt else optim.optimizer_step(pol.optimizer)
    for i, (model, _, layout) in enumerate(stages):
        writer = writer_dp_rank(layout, pol.groups.dp_size)
        gathered: Dict[str, torch.Tensor] = {}
        if megatron_opt:
            gathered = optim.gather_states(pol.optimizer, model.named_parameters(), pol.groups.dp,
                                           with_main=with_main, step=step, dst=writer)
        if pol.groups.dp_rank == writer:
            meta = {"optimizer_step": str(step), "scheduler_step": str(pol.scheduler.step_count),
                    "main_params": str(int(bool(gathered) and with_main))}
            save_shard(root, layout, {**policy_tensors(pol, i), **gathered}, meta)


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
        raise ValueError(f"{str(root / shard_file(0, 0))!r}: no optimizer/scheduler step in its metadata") from None
    megatron_opt = optim.is_megatron_optimizer(pol.optimizer)
    with_main = megatron_opt and meta.get("main_params") == "1"
    families = ["", *(f"optim.{k}." for k in optim.MOMENTS), "ref."] + (["optim.main."] if with_main else [])
    readers = {prefix: ShardedReader(root, pol.spec, saved, prefix) for prefix in families}

    def read(prefix: str, name: str, like: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        t = read_local_from_checkpoint(name, pol.spec, layout, readers[prefix], dtype or like.dtype)
        if t.shape != like.shape:
            raise ValueError(f"{prefix}{name}: checkpoint shape {tuple(t.shape)} != model {tuple(like.shape)}")
        return t

    # Megatron's distributed optimizer keeps fp32 moments and main weights whatever the
    # model's dtype, and only this DP rank's range of each (local_ranges): only that range is
    # kept (on the CPU; scatter_states moves it), so staging costs 1/DP of the stage's state.
    # The plain AdamW keeps full moments in the parameter's dtype.
    ranges = optim.local_ranges(pol.optimizer) if megatron_opt else {}
    staged: List[Tuple[torch.Tensor, torch.Tensor]] = []
    # per stage: {local name: moments}; names repeat across the chunks of a virtual pipeline
    moments: List[Dict[str, Dict[str, torch.Tensor]]] = []
    stages = policy_stages(pol)
    for model, ref, layout in stages:
        moments.append({})
        for name, p in model.named_parameters():
            t = read("", name, p)
            staged.append((p, t))
            if megatron_opt:
                if p not in ranges:
                    continue
                a, b = ranges[p]
                cut = {k: read(f"optim.{k}.", name, p, torch.float32) for k in optim.MOMENTS} if opt_step > 0 else {}
                cut["main"] = read("optim.main.", name, p, torch.float32) if with_main and opt_step > 0 else t.float()
                moments[-1][name] = {k: v.reshape(-1)[a:b].clone() for k, v in cut.items()}
            elif opt_step > 0:
                moments[-1][name] = {k: read(f"optim.{k}.", name, p) for k in optim.MOMENTS}
        if ref is not None:
            for name, p in ref.named_parameters():
                staged.append((p, read("ref.", name, p)))
    for p, t in staged:
        p.copy_(t.to(p.device))
    for (model, _, _), mom in zip(stages, moments):
        if megatron_opt:
            optim.scatter_states(pol.optimizer, model.named_parameters(), mom, opt_step)
            continue
        for name, p in model.named_parameters():
            if name in mom:
                pol.optimizer.state[p] = {"step": torch.tensor(float(opt_step)),
                                          **{k: v.to(p.device) for k, v in mom[name].items()}}
    pol.scheduler.set_step(sched_step)
