"""NeMo 2 checkpoints: ``DIR/weights/`` (megatron-core torch_dist) + ``DIR/context/``
(``model.yaml``, ``nemo_tokenizer/``, ``artifacts/``), read without NeMo, megatron-core or
running pickle: ``model.yaml`` by ``yaml.safe_load``, ``.metadata`` by the restricted
unpickler of ``dcp_index``, tensors by ``torch.load(weights_only=True)`` of their byte ranges;
``common.pt`` is never read. The tensors are global TP1 tensors, per-layer ones stacked on a
leading layer axis, so :class:`Nemo2Reader` is a ``shards.ShardedReader`` over a TP1 x PP1
transformer-engine layout. The writer needs megatron-core: ``backends/megatron/nemo2_writer``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Tuple

import torch

from nemo_d3s.errors import ConfigError
from nemo_d3s.formats.dcp_index import DcpIndex
from nemo_d3s.formats.shards import ShardedReader
from nemo_d3s.formats.side_files import nemo2_side_files
from nemo_d3s.formats.spec import ModelSpec
from nemo_d3s.formats.weights import Layout, local_names, local_shape

__all__ = [
    "Nemo2Reader",
    "open_nemo2_weights",
    "open_dcp_weights",
    "write_side_folder",
    "NEMO_PREFIX",
]

NEMO_PREFIX = "module."


def nemo_key(local: str, prefix: str = NEMO_PREFIX) -> Tuple[str, Tuple[int, ...]]:
    """A TP1 (transformer-engine names) local parameter -> (DCP fqn, its index on the stacked
    leading axes): layers are stacked under ``decoder.layers.<rest>`` (index (layer,)); an
    expert's weight, ``mlp.experts.linear_fc<i>.weight<k>`` (TEGroupedMLP) or
    ``mlp.experts.local_experts.<k>.linear_fc<i>.weight`` (SequentialMLP), under
    ``decoder.layers.mlp.experts.experts.linear_fc<i>.weight`` [L, E, ...] (index (layer, k)):
    both classes' ``sharded_state_dict`` map local expert k of EP rank p to global expert
    p E/EP + k on the axis after the layer's (megatron-core 0.16.1
    ``transformer/moe/experts.py`` TEGroupedMLP.sharded_state_dict :768-806, SequentialMLP's
    :935-975; TE's grouped linear ``extensions/transformer_engine.py`` :1738-1790). Anything
    else: (fqn, ()). ``prefix``: "module." (NeMo) or "" (Megatron-LM).
    """
    parts = local.split(".")
    if parts[:2] != ["decoder", "layers"]:
        return prefix + local, ()
    layer, rest = int(parts[2]), parts[3:]
    if rest[:2] == ["mlp", "experts"]:
        if len(rest) == 4 and rest[3].startswith("weight"):  # the TE spec's grouped GEMM
            fc, k = rest[2], int(rest[3][len("weight") :])
        elif len(rest) == 6 and rest[2] == "local_experts":
            fc, k = rest[4], int(rest[3])
        else:
            raise ValueError(f"{local!r} is no expert weight megatron-core names")
        return f"{prefix}decoder.layers.mlp.experts.experts.{fc}.weight", (layer, k)
    return prefix + "decoder.layers." + ".".join(rest), (layer,)


# A TE name -> where a checkpoint saved with another spec keeps it: the local spec's own names;
# a MoE layer's unfused pre-MLP norm, which the TE spec saves as ``pre_mlp_layernorm.weight``
# and the local spec, through its ``sharded_state_dict_keys_map`` (megatron-core 0.16.1
# models/gpt/gpt_layer_specs.py :416-419, dense or not), as ``mlp.linear_fc1.layer_norm_weight``.
_LOCAL_SPEC_NAMES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}


class Nemo2Reader(ShardedReader):
    """``shards.ShardedReader`` over a torch_dist checkpoint (NeMo 2 ``weights/``, a Megatron-LM
    ``iter_XXXXXXX/``), reading one layer's DCP chunks at a time. ``prefix``: the keys' prefix;
    ``config_name``: where the shape came from (for errors).
    """

    def __init__(
        self,
        folder: Path,
        spec: ModelSpec,
        index: DcpIndex,
        padded_vocab: int,
        prefix: str = NEMO_PREFIX,
        config_name: str = "context/model.yaml",
    ) -> None:
        self.index, self.prefix_key, self.config_name = index, prefix, config_name
        super().__init__(folder, spec, Layout(1, 1, 0, 0, padded_vocab, te=True))

    def fqn(self, local: str) -> Tuple[str, Tuple[int, ...]]:
        fqn, at = nemo_key(local, self.prefix_key)
        if fqn not in self.index.tensors:  # a checkpoint saved with the local spec's own names
            for te, plain in _LOCAL_SPEC_NAMES.items():
                alt = fqn.replace(te, plain)
                if alt in self.index.tensors:
                    return alt, at
        return fqn, at

    def check(self) -> torch.dtype:
        """Every tensor the table needs is indexed with the shape config says; returns the
        stored dtype."""
        dtypes = set()
        for local in local_names(self.spec, self.saved):
            fqn, at = self.fqn(local)
            if fqn not in self.index.tensors:
                raise ConfigError(
                    f"{str(self.index.weights / '.metadata')!r} holds no tensor {fqn!r} (not a "
                    f"{self.spec.architecture} checkpoint?)"
                )
            shape, dtype = self.index.tensors[fqn]
            # the stacked axes: layers, then (an expert's) experts
            stacked = (self.spec.num_layers, self.spec.num_experts)[: len(at)]
            want = stacked + local_shape(local, self.spec, self.saved)
            if shape != want:
                raise ConfigError(
                    f"{str(self.index.weights / '.metadata')!r}: tensor {fqn!r} has shape "
                    f"{list(shape)}, {self.config_name} gives {list(want)}"
                )
            if dtype not in (torch.float32, torch.bfloat16, torch.float16):
                raise ConfigError(
                    f"{str(self.index.weights / '.metadata')!r}: tensor {fqn!r} is {dtype}"
                )
            dtypes.add(dtype)
        if len(dtypes) != 1:
            raise ConfigError(
                f"{str(self.index.weights)!r} stores parameters in several dtypes "
                f"{sorted(map(str, dtypes))}"
            )
        return dtypes.pop()

    def _tensor(self, layout: Layout, key: str) -> torch.Tensor:
        fqn, at = self.fqn(key)
        if fqn not in self.index.tensors:
            raise ConfigError(f"{str(self.index.weights / '.metadata')!r} holds no tensor {fqn!r}")
        return self.index.read(fqn, at)


def open_nemo2_weights(folder: Path, spec: ModelSpec) -> Tuple[Nemo2Reader, torch.dtype]:
    """A NeMo 2 folder's weights (``weights/``) checked against ``spec``: (reader, stored dtype)."""
    return open_dcp_weights(folder / "weights", spec, NEMO_PREFIX, "context/model.yaml")


def open_dcp_weights(
    weights: Path, spec: ModelSpec, prefix: str, config_name: str
) -> Tuple[Nemo2Reader, torch.dtype]:
    """(reader, stored dtype) of the torch_dist folder ``weights`` (keys ``prefix`` + model names),
    checked against ``spec``; the padded vocabulary is the stored embedding's rows.
    """
    index = DcpIndex(weights)
    emb = prefix + "embedding.word_embeddings.weight"
    if emb not in index.tensors:
        raise ConfigError(
            f"{str(weights / '.metadata')!r} holds no tensor {emb!r} (not a GPT checkpoint?)"
        )
    padded = index.tensors[emb][0][0]
    if padded < spec.vocab_size:
        raise ConfigError(
            f"{str(weights)!r}: {emb!r} has {padded} rows, fewer than vocab_size="
            f"{spec.vocab_size} in {config_name}"
        )
    reader = Nemo2Reader(weights.parent, spec, index, padded, prefix, config_name)
    return reader, reader.check()


def write_side_folder(folder: Path, dst: Path) -> Path:
    """The HF-style folder ``dst`` a NeMo 2 training start reads besides the weights: config.json
    (from context/model.yaml), the tokenizer files and generation_config.json when present.
    """
    hint = "convert it with nemo-d3s-convert megatron-to-hf --hf-config DIR first"
    cfg, gen, files = nemo2_side_files(Path(folder), hint=hint)  # the converter's rule
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(
        json.dumps(cfg, indent=2, sort_keys=True) + "\n", encoding="utf-8"
    )
    for p in files:
        shutil.copyfile(p, dst / p.name)
    if gen is not None:
        shutil.copyfile(gen, dst / gen.name)
    return dst
