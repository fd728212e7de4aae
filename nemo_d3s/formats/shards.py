"""The Megatron backend's sharded checkpoint files: safetensors per (TP, PP) position,
loadable at any other TP x PP layout through the weight table. Files only (torch +
safetensors, no process group): which rank writes what, and the running policy's optimizer
state, are the backend's (``backends/megatron/checkpoint.py``); the converter writes and
reads the same files.

Layout of ``<step dir>/megatron/``::

    layout.json                  {"format": 1, "tp", "pp", "padded_vocab", "te", "ep", "etp",
                                 "spec": ModelSpec}
    tp{t:02d}_pp{p:02d}.safetensors   written by one DP rank of that position: the stage's
                                 parameters under Megatron's local names, the Adam moments
                                 as "optim.exp_avg.<name>" / "optim.exp_avg_sq.<name>" (Megatron's
                                 distributed optimizer: gathered over DP, fp32, plus its fp32
                                 main weights "optim.main.<name>" for bf16 models), the
                                 frozen reference as "ref.<name>"; metadata: optimizer step,
                                 LR-scheduler step, main_params (plain strings)
    ep{e:02d}_etp{t:02d}_pp{p:02d}.safetensors   mixture of experts: the expert parameters
                                 (``moe.is_expert_param``) of that expert position, the same
                                 families, written by one expert-DP rank of it

Why not ``megatron.core.dist_checkpointing``: its formats are read back with pickle (the
torch_dist ``.metadata`` file and ``common.pt``), and every file a run reads back here is
untrusted input. safetensors holds tensors and strings only. The trainer's checkpoint
manager adds atomicity (temporary folder + rename) and a SHA-256 per file on top.

Resharding: a rank of another layout rebuilds each of its local tensors from the HF-named
rows it covers (``weights.local_parts``), reading the saved TP shards of the stage that
holds them and reassembling the HF tensor (``weights.assemble_hf``). AdamW's moments have
their parameter's shape, so they reshard the same way: a checkpoint written at TP2 x PP2
resumes at TP1 x PP1 with model AND optimizer state, with either optimizer (plain AdamW or
Megatron's distributed optimizer, whose DP ranges are cut out of the full tensors: the
backend's ``backends/megatron/checkpoint.load_policy``).
"""

from __future__ import annotations

import json
from dataclasses import MISSING, fields
from functools import lru_cache
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

from nemo_d3s.errors import ConfigError
from nemo_d3s.formats.detect import LAYOUT_FILE, SHARDS_SUBDIR
from nemo_d3s.formats.safetensors_stream import check_safetensors
from nemo_d3s.formats.spec import ModelSpec
from nemo_d3s.formats.moe import is_expert_param
from nemo_d3s.formats.weights import (
    Layout,
    assemble_hf,
    local_names,
    local_parts,
    local_shape,
    read_local,
    split_size,
)

__all__ = [
    "FORMAT",
    "SUBDIR",
    "shard_file",
    "expert_shard_file",
    "file_of",
    "shard_plan",
    "write_layout",
    "read_layout",
    "ShardedReader",
    "save_shard",
    "read_local_from_checkpoint",
    "shard_metadata",
    "check_shards",
    "ST_DTYPES",
]

FORMAT = 1
SUBDIR = SHARDS_SUBDIR
# safetensors' dtype names of the parameter dtypes a checkpoint may hold
ST_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def shard_file(tp_rank: int, pp_rank: int) -> str:
    """The file name of the (tp_rank, pp_rank) shard."""
    return f"tp{tp_rank:02d}_pp{pp_rank:02d}.safetensors"


def expert_shard_file(ep_rank: int, etp_rank: int, pp_rank: int) -> str:
    """The file name of the experts of the (ep_rank, etp_rank, pp_rank) expert position."""
    return f"ep{ep_rank:02d}_etp{etp_rank:02d}_pp{pp_rank:02d}.safetensors"


def file_of(name: str, layout: Layout) -> str:
    """The shard file holding local tensor ``name`` (any family prefix) of ``layout``'s rank."""
    if is_expert_param(name):
        return expert_shard_file(layout.ep_rank, layout.etp_rank, layout.pp_rank)
    return shard_file(layout.tp_rank, layout.pp_rank)


def shard_plan(spec: ModelSpec, layout: Layout) -> List[Tuple[str, Layout, List[str]]]:
    """Every file of a checkpoint at ``layout``'s sizes: (file name, the layout of its
    position, the local parameter names it holds), dense files per (TP, PP) and, for a
    mixture of experts, expert files per (EP, ETP, PP)."""
    plan = []
    for p in range(layout.pp):
        for t in range(layout.tp):
            lay = layout.at(t, p, ep_rank=0, etp_rank=0)
            names = [n for n in local_names(spec, lay) if not is_expert_param(n)]
            plan.append((shard_file(t, p), lay, names))
        for e in range(layout.ep if spec.num_experts else 0):
            for t in range(layout.etp):
                lay = layout.at(0, p, ep_rank=e, etp_rank=t)
                names = [n for n in local_names(spec, lay) if is_expert_param(n)]
                plan.append((expert_shard_file(e, t, p), lay, names))
    return plan


def write_layout(folder: Path, spec: ModelSpec, layout: Layout) -> None:
    """Write ``folder``'s layout.json: format, TP, PP, padded vocabulary, TE names, EP and
    ETP, the spec."""
    (folder / LAYOUT_FILE).write_text(
        json.dumps(
            {
                "format": FORMAT,
                "tp": layout.tp,
                "pp": layout.pp,
                "padded_vocab": layout.padded_vocab,
                "te": layout.te,
                "ep": layout.ep,
                "etp": layout.etp,
                "spec": spec.to_dict(),
            },
            indent=1,
        )
    )


def read_layout(folder: Path, spec: ModelSpec) -> Layout:
    """The saved layout; ConfigError when the checkpoint is of another model (any field of
    the model shape differs; the dtype may)."""
    path = folder / LAYOUT_FILE
    try:
        raw = json.loads(path.read_text())
        saved = raw["spec"]
        if raw.get("format") != FORMAT:
            raise ValueError(f"format {raw.get('format')!r} (this version reads {FORMAT})")
        tp, pp, pv = int(raw["tp"]), int(raw["pp"]), int(raw["padded_vocab"])
        ep, etp = int(raw.get("ep", 1)), int(raw.get("etp", 1))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(
            f"{str(path)!r}: not a nemo_d3s Megatron checkpoint layout ({e})"
        ) from None
    mine = spec.to_dict()
    # a field added to ModelSpec since the checkpoint was written reads as its default
    defaults = {f.name: f.default for f in fields(ModelSpec) if f.default is not MISSING}
    got = {k: saved.get(k, defaults.get(k)) for k in mine}
    diff = [k for k in mine if k != "torch_dtype" and got[k] != mine[k]]
    if diff:
        k = diff[0]
        raise ConfigError(
            f"{str(path)!r} is a checkpoint of another model: {k}={got[k]!r} there, "
            f"{mine[k]!r} here"
        )
    return Layout(tp, pp, 0, 0, pv, bool(raw.get("te", False)), ep=ep, etp=etp)


def save_shard(
    folder: Path,
    layout: Layout,
    tensors: Dict[str, torch.Tensor],
    metadata: Dict[str, str],
    file: Optional[str] = None,
) -> None:
    """Write one shard file of ``tensors`` with its metadata into ``folder``: ``file``, by
    default the (tp, pp) one of ``layout``."""
    from safetensors.torch import save_file

    save_file(
        {k: v.detach().contiguous().cpu() for k, v in tensors.items()},
        str(folder / (file or shard_file(layout.tp_rank, layout.pp_rank))),
        metadata=metadata,
    )


class ShardedReader:
    """HF-named row ranges out of a saved sharded checkpoint (any layout), duck-typing
    ``weights.SafetensorsReader`` so :func:`weights.read_local` builds a local tensor of the
    CURRENT layout from it. ``prefix`` selects the saved family ("" = parameters,
    "optim.exp_avg." = first moments, ...). Files are opened lazily and only the shards of
    the stage that holds a requested tensor are read."""

    def __init__(self, folder: Path, spec: ModelSpec, saved: Layout, prefix: str = "") -> None:
        self.folder, self.spec, self.saved, self.prefix = folder, spec, saved, prefix
        self._where: Dict[str, Tuple[int, int, str]] = {}
        for stage in range(saved.pp):
            for e in range(saved.ep if spec.num_experts else 1):
                st = saved.at(0, stage, ep_rank=e, etp_rank=0)
                for local in local_names(spec, st):
                    if local == "output_layer.weight" and spec.tie_word_embeddings:
                        continue
                    if e and not is_expert_param(local):
                        continue  # dense tensors: the same on every EP rank
                    for part in local_parts(local, spec, st)[1]:
                        if part.hf_name is not None:
                            self._where.setdefault(part.hf_name, (stage, e, local))
        self._full = lru_cache(maxsize=1)(self._assemble)

    def _tensor(self, layout: Layout, key: str) -> torch.Tensor:
        from safetensors import safe_open

        path = self.folder / file_of(key, layout)
        if not path.is_file():
            raise ConfigError(f"{str(path)!r} is missing from the checkpoint")
        with safe_open(str(path), framework="pt") as f:
            if key not in f.keys():
                raise ConfigError(f"{str(path)!r} holds no tensor {key!r}")
            return f.get_tensor(key)

    def _assemble(self, stage: int, ep_rank: int, local: str) -> Dict[str, torch.Tensor]:
        st = self.saved.at(0, stage, ep_rank=ep_rank, etp_rank=0)
        shards = [
            self._tensor(st.split_rank(local, r), self.prefix + local)
            for r in range(split_size(local, self.saved))
        ]
        return assemble_hf(local, shards, self.spec, st)

    def rows(self, name: str, dim: int, lo: int, hi: int) -> torch.Tensor:
        return self._full(*self._where[name])[name].narrow(dim, lo, hi - lo)

    def same_layout_tensor(self, layout: Layout, key: str) -> torch.Tensor:
        return self._tensor(layout, key)


def read_local_from_checkpoint(
    name: str, spec: ModelSpec, layout: Layout, reader: ShardedReader, dtype: torch.dtype
) -> torch.Tensor:
    """Local tensor ``name`` of ``layout`` from the checkpoint: the saved shard itself when
    the layouts agree (bit-exact, padding rows included), else rebuilt through the table."""
    s = reader.saved
    same = (s.tp, s.pp, s.padded_vocab, s.te) == (
        layout.tp,
        layout.pp,
        layout.padded_vocab,
        layout.te,
    )
    if same and (not is_expert_param(name) or (s.ep, s.etp) == (layout.ep, layout.etp)):
        return reader.same_layout_tensor(layout, reader.prefix + name).to(dtype)
    return read_local(name, spec, layout, reader, dtype)


def shard_metadata(folder: Path, layout: Layout) -> Optional[Dict[str, str]]:
    """The safetensors metadata of the (tp, pp) shard in ``folder``; None if it is absent."""
    from safetensors import safe_open

    path = folder / shard_file(layout.tp_rank, layout.pp_rank)
    if not path.is_file():
        return None
    with safe_open(str(path), framework="pt") as f:
        return f.metadata() or {}


def check_shards(root: Path, spec: ModelSpec, saved: Layout) -> Optional[torch.dtype]:
    """Every shard file of the saved layout exists and holds every parameter of its
    position with the shape the table gives for config.json (header reads only). Returns
    the parameters' stored dtype (None when mixed)."""
    from safetensors import safe_open

    dtypes = set()
    for fname, lay, names in shard_plan(spec, saved):
        path = root / fname
        if not path.is_file():
            raise ConfigError(
                f"{str(path)!r} is missing: {root / LAYOUT_FILE} says TP{saved.tp} x "
                f"PP{saved.pp}" + (f" x EP{saved.ep} x ETP{saved.etp}" if saved.ep > 1 else "")
            )
        check_safetensors(path)  # truncated or garbled: one line naming the file
        try:
            f = safe_open(str(path), framework="pt")
        except Exception as e:
            raise ConfigError(f"{str(path)!r} is not a safetensors file ({e})") from None
        keys = set(f.keys())
        for name in names:
            if name not in keys:
                raise ConfigError(
                    f"{str(path)!r} holds no tensor {name!r} (a checkpoint of another model or "
                    "layer spec?)"
                )
            sl = f.get_slice(name)
            got, want = tuple(sl.get_shape()), local_shape(name, spec, lay)
            if got != want:
                raise ConfigError(
                    f"{str(path)!r}: tensor {name!r} has shape {list(got)}, config.json gives "
                    f"{list(want)} in that layout (a checkpoint of another model?)"
                )
            dt = sl.get_dtype()
            if dt not in ST_DTYPES:
                raise ConfigError(
                    f"{str(path)!r}: tensor {name!r} is {dt}; expected F32, BF16 or F16"
                )
            dtypes.add(ST_DTYPES[dt])
        del f
    return dtypes.pop() if len(dtypes) == 1 else None
