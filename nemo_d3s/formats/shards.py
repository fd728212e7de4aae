"""The Megatron backend's sharded checkpoint files, loadable at any TP x PP (x EP) through the
weight table; files only (which rank writes what is the backend's). ``<step dir>/megatron/``
holds ``layout.json`` ({"format": 1, "tp", "pp", "padded_vocab", "te", "ep", "etp", "spec"}),
``tp{t:02d}_pp{p:02d}.safetensors``: the stage's parameters under Megatron's local names,
"optim.exp_avg.", "optim.exp_avg_sq." (fp32, gathered over DP), "optim.main." and "ref."
families, optimizer / scheduler steps as metadata; and, for a mixture of experts,
``ep{e:02d}_etp{t:02d}_pp{p:02d}.safetensors``: the expert parameters (``moe.is_expert_param``)
of that expert position, the same families. safetensors, not ``dist_checkpointing``, because
that reads back with pickle. Moments have their parameter's shape, so model and optimizer
state reshard alike (``weights.local_parts`` / ``weights.assemble_hf``).
"""

from __future__ import annotations

import json
from dataclasses import MISSING, fields
from functools import lru_cache
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from nemo_d3s.errors import ConfigError
from nemo_d3s.formats.detect import LAYOUT_FILE, SHARDS_SUBDIR
from nemo_d3s.formats.safetensors_stream import StreamingSafetensors, check_safetensors
from nemo_d3s.formats.spec import ModelSpec, check_layout, smallest_world
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
    "open_shard",
    "read_local_from_checkpoint",
    "read_range_from_checkpoint",
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
    """The saved layout; ConfigError naming layout.json when the checkpoint is of another
    model (any field of the model shape differs; the dtype may) or its sizes are not a layout
    of ``spec`` (TP / PP / EP < 1, a padded vocabulary short of the real one, which would
    leave rows of the exported embedding unwritten, or not split by TP; any rule
    ``check_layout`` states). Every reader of the files calls this, so all check alike."""
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
    if tp < 1 or pp < 1 or spec.num_layers % pp or pv < spec.vocab_size or pv % tp:
        raise ConfigError(
            f"{str(path)!r}: TP{tp} x PP{pp} with padded vocabulary {pv} is not a layout of "
            f"this model ({spec.num_layers} layers, vocabulary {spec.vocab_size})"
        )
    try:  # the expert sizes too: an EP of 0 indexes no expert file, then a bare KeyError
        world = smallest_world(tp, pp, ep, etp)
        check_layout(spec, tp=tp, pp=pp, world=world, ep=ep, etp=etp)
    except ConfigError as e:
        raise ConfigError(f"{str(path)!r}: {e}") from None
    return Layout(tp, pp, 0, 0, pv, bool(raw.get("te", False)), ep=ep, etp=etp)


def open_shard(
    folder: Path,
    layout: Layout,
    entries: Sequence[Tuple[str, Tuple[int, ...], torch.dtype]],
    metadata: Dict[str, str],
    file: Optional[str] = None,
) -> StreamingSafetensors:
    """Shard file ``file`` (default: the (tp, pp) one of ``layout``) in ``folder``, written
    tensor by tensor: its header from ``entries`` (name, shape, dtype), each tensor as it comes
    (``write``)."""
    return StreamingSafetensors(
        folder / (file or shard_file(layout.tp_rank, layout.pp_rank)), entries, metadata
    )


class ShardedReader:
    """HF-named row ranges out of a saved sharded checkpoint of any layout (duck-types
    ``weights.SafetensorsReader``); ``prefix`` picks the family ("" parameters, "optim.exp_avg."
    ...). Only the shards of the stage holding a requested tensor are read.
    """

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
        return self._read(layout, key)[0]

    def _read(
        self, layout: Layout, key: str, rows: Optional[Tuple[int, int]] = None
    ) -> Tuple[torch.Tensor, Tuple[int, ...]]:
        """(tensor ``key`` of ``layout``'s saved shard, dense or expert, or only its dim-0
        ``rows`` through safetensors' lazy slice; its saved shape)."""
        from safetensors import safe_open

        path = self.folder / file_of(key, layout)
        if not path.is_file():
            raise ConfigError(f"{str(path)!r} is missing from the checkpoint")
        with safe_open(str(path), framework="pt") as f:
            if key not in f.keys():
                raise ConfigError(f"{str(path)!r} holds no tensor {key!r}")
            part = f.get_slice(key)
            shape = tuple(int(n) for n in part.get_shape())
            return (f.get_tensor(key) if rows is None else part[rows[0] : rows[1]]), shape

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

    def same_layout_rows(
        self, layout: Layout, key: str, lo: int, hi: int
    ) -> Tuple[torch.Tensor, Tuple[int, ...]]:
        """Rows [lo, hi) (dim 0) of ``key`` in ``layout``'s own shard, and the saved shape:
        only those rows' bytes are read."""
        return self._read(layout, key, (lo, hi))


def read_local_from_checkpoint(
    name: str, spec: ModelSpec, layout: Layout, reader: ShardedReader, dtype: torch.dtype
) -> torch.Tensor:
    """Local tensor ``name`` of ``layout`` from the checkpoint: the saved shard itself when
    the layouts agree (bit-exact, padding rows included), else rebuilt through the table."""
    if _saved_as(name, reader.saved, layout):
        return reader.same_layout_tensor(layout, reader.prefix + name).to(dtype)
    return read_local(name, spec, layout, reader, dtype)


def _saved_as(name: str, saved: Layout, layout: Layout) -> bool:
    """Whether local tensor ``name`` of ``layout`` is stored as is in the ``saved`` layout's
    files (same TP, PP, padded vocabulary, TE names; same EP and ETP for an expert)."""
    s = saved
    same = (s.tp, s.pp, s.padded_vocab, s.te) == (
        layout.tp,
        layout.pp,
        layout.padded_vocab,
        layout.te,
    )
    return same and (not is_expert_param(name) or (s.ep, s.etp) == (layout.ep, layout.etp))


def read_range_from_checkpoint(
    name: str,
    spec: ModelSpec,
    layout: Layout,
    reader: ShardedReader,
    dtype: torch.dtype,
    shape: Tuple[int, ...],
    start: int,
    end: int,
) -> torch.Tensor:
    """``[start, end)`` of the flattened local tensor ``name`` (of ``shape``): a distributed
    optimizer's DP range. At the saved layout only the rows that hold the range are read
    (1/DP of the tensor's bytes per DP rank); at another layout the local tensor is rebuilt
    whole first (resharding reads what it reassembles). ValueError on a shape mismatch."""
    row = 1
    for n in shape[1:]:
        row *= int(n)
    lo, hi = start // row, -(-end // row)
    if _saved_as(name, reader.saved, layout):
        rows, saved = reader.same_layout_rows(layout, reader.prefix + name, lo, hi)
    else:
        full = read_local(name, spec, layout, reader, dtype)
        rows, saved = full[lo:hi], tuple(full.shape)
    if saved != tuple(shape):
        raise ValueError(f"{reader.prefix}{name}: checkpoint shape {saved} != model {tuple(shape)}")
    return rows.to(dtype).reshape(-1)[start - lo * row : end - lo * row].clone()


def shard_metadata(folder: Path, layout: Layout) -> Optional[Dict[str, str]]:
    """The safetensors metadata of the (tp, pp) shard in ``folder``; None if it is absent."""
    from safetensors import safe_open

    path = folder / shard_file(layout.tp_rank, layout.pp_rank)
    if not path.is_file():
        return None
    with safe_open(str(path), framework="pt") as f:
        return f.metadata() or {}


def check_shards(root: Path, spec: ModelSpec, saved: Layout) -> Optional[torch.dtype]:
    """Every shard file of the saved layout exists and holds each parameter with the table's shape
    (headers only). Returns the stored dtype (None when mixed).
    """
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
