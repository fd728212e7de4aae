"""The one table of names and shapes between Hugging Face Llama/Qwen2/Qwen3 weights and the
TP x PP shards of a megatron-core ``GPTModel``; load, export, refit, resharding and the
converter all go through :func:`local_parts`. A local parameter of rank (tp_rank, pp_rank) is
the concatenation along one dim of row ranges of HF tensors (and zero rows for vocabulary
padding): :func:`read_local` reads only this rank's rows, :func:`assemble_hf` inverts it.

Per layer (H hidden, d head_dim, G query groups, q = heads/G, F ffn):
``linear_qkv.weight`` [(q + 2) d G / TP, H] per group g: q query heads, k_g, v_g (bias alike);
``linear_proj.weight`` [H, q d G / TP]; ``linear_fc1.weight`` [2 F / TP, H] = [gate_r; up_r];
``linear_fc2.weight`` [H, F / TP]; ``q_layernorm`` / ``k_layernorm`` [d] (Qwen3 ``q_norm`` /
``k_norm``): replicated over TP, gradient a TP partial sum, refit under transformers' names
(vllm/model_executor/models/qwen3.py at 002456df: ``Qwen3Attention.q_norm``); layer norms
replicated (fused into the next linear with transformer-engine); embedding / output layer
[Vp / TP, H] over the padded vocabulary Vp, rows >= V zero and never exported; tied: the first
stage's embedding is the weight, the last stage's ``output_layer`` a copy. Layers are numbered
per stage in Megatron, globally in HF.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from nemo_d3s.formats.safetensors_stream import ST_NAME, check_safetensors
from nemo_d3s.formats.spec import ModelSpec
from nemo_d3s.formats.moe import (
    is_expert_param,
    moe_hf_names,
    moe_hf_shape,
    moe_local_names,
    moe_local_parts,
    swiglu_rows,
)
from nemo_d3s.errors import ConfigError

__all__ = [
    "Part",
    "Layout",
    "local_names",
    "local_parts",
    "local_shape",
    "hf_names",
    "hf_shape",
    "SafetensorsReader",
    "assemble_hf",
    "split_size",
]


@dataclass(frozen=True)
class Layout:
    """Where a rank sits: TP/PP sizes and ranks, the padded vocabulary, the layer spec, and
    for experts (``formats/moe.py``) the EP and expert-TP sizes and ranks."""

    tp: int = 1
    pp: int = 1
    tp_rank: int = 0
    pp_rank: int = 0
    padded_vocab: int = 0
    te: bool = False  # transformer-engine spec: norms fused into the following linear
    ep: int = 1
    ep_rank: int = 0
    etp: int = 1
    etp_rank: int = 0

    def at(
        self,
        tp_rank: int,
        pp_rank: Optional[int] = None,
        *,
        ep_rank: Optional[int] = None,
        etp_rank: Optional[int] = None,
    ) -> "Layout":
        return replace(
            self,
            tp_rank=tp_rank,
            pp_rank=self.pp_rank if pp_rank is None else pp_rank,
            ep_rank=self.ep_rank if ep_rank is None else ep_rank,
            etp_rank=self.etp_rank if etp_rank is None else etp_rank,
        )

    def split_rank(self, name: str, r: int) -> "Layout":
        """This layout at rank ``r`` of the group that splits parameter ``name``: ETP for an
        expert's, TP for any other."""
        if is_expert_param(name):
            return self.at(self.tp_rank, etp_rank=r)
        return self.at(r)


def split_size(name: str, layout: Layout) -> int:
    """How many ranks split parameter ``name``: ETP for an expert's, TP for any other."""
    return layout.etp if is_expert_param(name) else layout.tp


@dataclass(frozen=True)
class Part:
    """Rows [lo, hi) along the local tensor's concatenation dim from HF tensor ``hf_name`` (same
    rows of it); ``hf_name`` None: hi - lo zero rows (vocabulary padding).
    """

    hf_name: Optional[str]
    lo: int
    hi: int

    @property
    def rows(self) -> int:
        return self.hi - self.lo


def _layers_of_stage(spec: ModelSpec, layout: Layout) -> range:
    per = spec.num_layers // layout.pp
    return range(layout.pp_rank * per, (layout.pp_rank + 1) * per)


def _has_output_layer(spec: ModelSpec, layout: Layout) -> bool:
    last = layout.pp_rank == layout.pp - 1
    return last and (not spec.tie_word_embeddings or layout.pp > 1)


def _qkv_extras(p: str, spec: ModelSpec) -> List[str]:
    """What follows ``linear_qkv.weight`` in a layer's ``named_parameters``: bias, q / k norms
    (megatron-core's ``SelfAttention`` builds them in that order).
    """
    out = [p + "self_attention.linear_qkv.bias"] if spec.qkv_bias else []
    if spec.qk_norm:
        out += [p + "self_attention.q_layernorm.weight", p + "self_attention.k_layernorm.weight"]
    return out


def local_names(spec: ModelSpec, layout: Layout) -> List[str]:
    """The parameter names of this stage's GPTModel, in ``named_parameters`` order."""
    names: List[str] = []
    if layout.pp_rank == 0:
        names.append("embedding.word_embeddings.weight")
    for j, _ in enumerate(_layers_of_stage(spec, layout)):
        p = f"decoder.layers.{j}."
        if layout.te:
            names += [
                p + "self_attention.linear_proj.weight",
                p + "self_attention.linear_qkv.layer_norm_weight",
                p + "self_attention.linear_qkv.weight",
            ]
            names += _qkv_extras(p, spec)
            if spec.num_experts:  # megatron-core's TE spec does not fuse the MoE's norm
                names += [p + "pre_mlp_layernorm.weight"] + moe_local_names(spec, layout, p)
                continue
            names += [
                p + "mlp.linear_fc1.layer_norm_weight",
                p + "mlp.linear_fc1.weight",
                p + "mlp.linear_fc2.weight",
            ]
        else:
            names += [
                p + "input_layernorm.weight",
                p + "self_attention.linear_proj.weight",
                p + "self_attention.linear_qkv.weight",
            ]
            names += _qkv_extras(p, spec)
            names.append(p + "pre_mlp_layernorm.weight")
            if spec.num_experts:
                names += moe_local_names(spec, layout, p)
                continue
            names += [p + "mlp.linear_fc1.weight", p + "mlp.linear_fc2.weight"]
    if layout.pp_rank == layout.pp - 1:
        names.append("decoder.final_layernorm.weight")
        if _has_output_layer(spec, layout):
            names.append("output_layer.weight")
    return names


def _vocab_parts(hf_name: str, spec: ModelSpec, layout: Layout) -> List[Part]:
    per = layout.padded_vocab // layout.tp
    lo, hi = layout.tp_rank * per, (layout.tp_rank + 1) * per
    real_hi = min(hi, spec.vocab_size)
    parts = [Part(hf_name, lo, real_hi)] if real_hi > lo else []
    if hi > max(lo, spec.vocab_size):
        parts.append(Part(None, max(lo, spec.vocab_size), hi))
    return parts


def local_parts(name: str, spec: ModelSpec, layout: Layout) -> Tuple[int, List[Part]]:
    """(concatenation dim, parts) of local parameter ``name`` at ``layout`` (see the module
    docstring); a replicated parameter is one part covering the whole HF tensor."""
    tp, r = layout.tp, layout.tp_rank
    d, G, H, F = spec.head_dim, spec.kv_heads, spec.hidden_size, spec.ffn_hidden_size
    q = spec.num_heads // G
    if name == "embedding.word_embeddings.weight":
        return 0, _vocab_parts("model.embed_tokens.weight", spec, layout)
    if name == "output_layer.weight":
        src = "model.embed_tokens.weight" if spec.tie_word_embeddings else "lm_head.weight"
        return 0, _vocab_parts(src, spec, layout)
    if name == "decoder.final_layernorm.weight":
        return 0, [Part("model.norm.weight", 0, H)]
    parts = name.split(".")
    if parts[:2] != ["decoder", "layers"]:
        raise KeyError(f"no Hugging Face counterpart for Megatron parameter {name!r}")
    i = _layers_of_stage(spec, layout)[int(parts[2])]
    hf, rest = f"model.layers.{i}.", ".".join(parts[3:])
    if rest in ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"):
        return 0, [Part(hf + "input_layernorm.weight", 0, H)]
    if rest in ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"):
        return 0, [Part(hf + "post_attention_layernorm.weight", 0, H)]
    if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = rest.rsplit(".", 1)[1]
        out: List[Part] = []
        for g in range(r * G // tp, (r + 1) * G // tp):
            out += [
                Part(hf + f"self_attn.q_proj.{kind}", g * q * d, (g + 1) * q * d),
                Part(hf + f"self_attn.k_proj.{kind}", g * d, (g + 1) * d),
                Part(hf + f"self_attn.v_proj.{kind}", g * d, (g + 1) * d),
            ]
        return 0, out
    if rest in ("self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"):
        return 0, [Part(hf + f"self_attn.{rest.split('.')[1][0]}_norm.weight", 0, d)]
    moe = moe_local_parts(rest, hf, spec, layout)
    if moe is not None:
        return moe[0], [Part(*row) for row in moe[1]]
    if rest == "self_attention.linear_proj.weight":
        w = q * d * G // tp
        return 1, [Part(hf + "self_attn.o_proj.weight", r * w, (r + 1) * w)]
    fc = {"mlp.linear_fc1.weight": 1, "mlp.linear_fc2.weight": 2}.get(rest)
    if fc is not None:
        dim, rows = swiglu_rows(hf + "mlp.", ("gate_proj", "up_proj", "down_proj"), F, tp, r, fc)
        return dim, [Part(*row) for row in rows]
    raise KeyError(f"no Hugging Face counterpart for Megatron parameter {name!r}")


def hf_shape(hf_name: str, spec: ModelSpec) -> Tuple[int, ...]:
    """The full shape of an HF tensor of ``spec``."""
    H, d, F, V = spec.hidden_size, spec.head_dim, spec.ffn_hidden_size, spec.vocab_size
    last = hf_name.rsplit(".", 2)
    key = ".".join(last[-2:])
    moe = moe_hf_shape(hf_name, spec)
    if moe is not None:
        return moe
    if hf_name in ("model.embed_tokens.weight", "lm_head.weight"):
        return (V, H)
    if hf_name == "model.norm.weight" or key in (
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
    ):
        return (H,)
    table = {
        "q_proj.weight": (spec.num_heads * d, H),
        "k_proj.weight": (spec.kv_heads * d, H),
        "v_proj.weight": (spec.kv_heads * d, H),
        "q_proj.bias": (spec.num_heads * d,),
        "k_proj.bias": (spec.kv_heads * d,),
        "v_proj.bias": (spec.kv_heads * d,),
        "o_proj.weight": (H, spec.num_heads * d),
        "q_norm.weight": (d,),
        "k_norm.weight": (d,),
        "gate_proj.weight": (F, H),
        "up_proj.weight": (F, H),
        "down_proj.weight": (H, F),
    }
    if key not in table:
        raise KeyError(f"{hf_name!r} is not a tensor of a {spec.architecture}")
    return table[key]


def local_shape(name: str, spec: ModelSpec, layout: Layout) -> Tuple[int, ...]:
    """The shape of tensor ``name`` on ``layout``'s rank (its TP part, vocabulary padded)."""
    dim, parts = local_parts(name, spec, layout)
    ref = parts[0].hf_name or "model.embed_tokens.weight"
    shape = list(hf_shape(ref, spec))
    shape[dim] = sum(p.rows for p in parts)
    return tuple(shape)


def hf_names(spec: ModelSpec) -> List[str]:
    """Every tensor of the HF checkpoint, in transformers' order (tied: no lm_head)."""
    names = ["model.embed_tokens.weight"]
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        names += [p + f"self_attn.{x}_proj.weight" for x in "qkvo"]
        if spec.qkv_bias:
            names += [p + f"self_attn.{x}_proj.bias" for x in "qkv"]
        if spec.qk_norm:
            names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        if spec.num_experts:
            names += moe_hf_names(spec, i)
        else:
            names += [p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
    names.append("model.norm.weight")
    if not spec.tie_word_embeddings:
        names.append("lm_head.weight")
    return names


# ---------------------------------------------------------------------------- reading HF files
class SafetensorsReader:
    """Lazy row ranges of an HF folder's tensors (one file or an indexed set): only the requested
    rows come off disk. A missing tensor or one of another shape than ``spec`` is a ConfigError
    naming tensor and file, raised before any weight is written.
    """

    def __init__(self, folder: str | os.PathLike, spec: ModelSpec) -> None:
        self.folder, self.spec = Path(folder), spec
        index = self.folder / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                if not isinstance(weight_map, dict):
                    raise TypeError("weight_map is not an object")
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise ConfigError(f"{str(index)!r}: not a safetensors index ({e})") from None
            self.files = {str(k): self.folder / str(v) for k, v in weight_map.items()}
            for f in sorted(set(self.files.values())):
                if f.resolve().parent != self.folder.resolve():
                    raise ConfigError(f"{str(index)!r} points outside the model folder: {str(f)!r}")
                if f.is_file():
                    check_safetensors(f)
        elif (self.folder / "model.safetensors").is_file():
            from safetensors import safe_open

            single = self.folder / "model.safetensors"
            check_safetensors(single)
            with safe_open(str(single), framework="pt") as f:
                self.files = {k: single for k in f.keys()}
        else:
            raise ConfigError(
                f"{str(self.folder)!r} holds no model.safetensors (or index): the Megatron "
                "backend loads safetensors weights only (convert .bin/.pt checkpoints "
                "with transformers first)"
            )
        self._open: Dict[Path, object] = {}

    def _handle(self, path: Path):
        if path not in self._open:
            from safetensors import safe_open

            if not path.is_file():
                raise ConfigError(f"{str(path)!r} (named by the safetensors index) is missing")
            self._open[path] = safe_open(str(path), framework="pt")
        return self._open[path]

    def check(self) -> None:
        """Every tensor ``spec`` needs exists with the right shape (header reads only)."""
        held: Dict[Path, set] = {}
        for name in hf_names(self.spec):
            if name not in self.files:
                raise ConfigError(
                    f"{str(self.folder)!r}: tensor {name!r} is missing (not a "
                    f"{self.spec.architecture} with this config.json?)"
                )
            handle = self._handle(self.files[name])
            if self.files[name] not in held:  # a set per file: a MoE has ~10^5 tensors
                held[self.files[name]] = set(handle.keys())
            if name not in held[self.files[name]]:  # else safetensors' error, naming no file
                raise ConfigError(
                    f"{str(self.folder / 'model.safetensors.index.json')!r} maps tensor "
                    f"{name!r} to {str(self.files[name])!r}, which does not hold it"
                )
            sl = handle.get_slice(name)
            got, want = tuple(sl.get_shape()), hf_shape(name, self.spec)
            if got != want:
                raise ConfigError(
                    f"{str(self.files[name])!r}: tensor {name!r} has shape {list(got)}, "
                    f"config.json says {list(want)} (a checkpoint from another model?)"
                )
            # an FP8 / integer tensor would be cast to the run's dtype as garbage (its scales
            # live in other tensors the table never reads)
            if sl.get_dtype() not in ST_NAME.values():
                raise ConfigError(
                    f"{str(self.files[name])!r}: tensor {name!r} is {sl.get_dtype()}; "
                    f"expected {', '.join(ST_NAME.values())} (quantized weights are not read)"
                )

    def rows(self, name: str, dim: int, lo: int, hi: int) -> torch.Tensor:
        sl = self._handle(self.files[name]).get_slice(name)
        return sl[lo:hi] if dim == 0 else sl[:, lo:hi]

    def close(self) -> None:
        self._open.clear()


def read_local(
    name: str, spec: ModelSpec, layout: Layout, reader: SafetensorsReader, dtype: torch.dtype
) -> torch.Tensor:
    """Local parameter ``name`` at ``layout`` built from the HF files (zero padding rows)."""
    dim, parts = local_parts(name, spec, layout)
    pieces = []
    for p in parts:
        if p.hf_name is None:
            shape = list(hf_shape("model.embed_tokens.weight", spec))
            shape[dim] = p.rows
            pieces.append(torch.zeros(shape, dtype=dtype))
        else:
            pieces.append(reader.rows(p.hf_name, dim, p.lo, p.hi).to(dtype))
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)


def assemble_hf(
    name: str, shards: Sequence[torch.Tensor], spec: ModelSpec, layout: Layout
) -> Dict[str, torch.Tensor]:
    """Inverse of :func:`local_parts` for one parameter: its TP shards (index = TP rank, stage
    ``layout.pp_rank``; an expert's: ETP rank) -> {HF name: full tensor}; replicated ones from
    rank 0, padding dropped.
    """
    out: Dict[str, torch.Tensor] = {}
    for r, shard in enumerate(shards):
        dim, parts = local_parts(name, spec, layout.split_rank(name, r))
        if (
            r > 0
            and len(parts) == 1
            and parts[0].lo == 0
            and parts[0].rows == hf_shape(parts[0].hf_name, spec)[dim]
        ):
            continue  # replicated over TP: rank 0's copy is the weight
        offset = 0
        for p in parts:
            if p.hf_name is not None:
                if p.hf_name not in out:
                    out[p.hf_name] = shard.new_empty(hf_shape(p.hf_name, spec))
                piece = shard.narrow(dim, offset, p.rows)
                out[p.hf_name].narrow(dim, p.lo, p.rows).copy_(piece)
            offset += p.rows
    return out


def iter_stage_hf(
    names: Sequence[str], spec: ModelSpec, layout: Layout
) -> Iterator[Tuple[str, List[str]]]:
    """(local name, HF names it produces) for the given local names, in order."""
    for n in names:
        _, parts = local_parts(n, spec, layout)
        seen: List[str] = []
        for r in range(split_size(n, layout)):
            for p in local_parts(n, spec, layout.split_rank(n, r))[1]:
                if p.hf_name is not None and p.hf_name not in seen:
                    seen.append(p.hf_name)
        yield n, seen
