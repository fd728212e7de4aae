"""NeMo 2 checkpoints: ``DIR/weights/`` (a megatron-core ``dist_checkpointing`` checkpoint in
the ``torch_dist`` format) + ``DIR/context/`` (``model.yaml``: the model config as NeMo's
fiddle YAML; ``nemo_tokenizer/``: the HF tokenizer files; ``artifacts/``: the generation
config). What NeMo users have after SFT (``llm.import_ckpt`` writes the same layout).

The Megatron backend starts training from such a folder (``model.name=<NeMo 2 folder>``:
:func:`open_nemo2_weights` for the weights, :func:`write_side_folder` for config and
tokenizer); ``nemo-d3s-convert`` reads and writes them.

Reading needs neither NeMo nor megatron-core, and runs no pickle from the checkpoint:

- ``context/model.yaml`` is read with ``yaml.safe_load`` and mapped to an HF config dict
  (``nemo2_context.hf_config_from_nemo``; Llama / Llama 3.1 RoPE scaling, Mistral, Qwen2).
- ``weights/.metadata`` (torch DCP's index, a pickle) is read with an unpickler that builds
  only the DCP/megatron metadata classes, torch.Size and dtypes (``dcp_index._MetadataUnpickler``);
  anything else is refused. Tensors are ``torch.load(weights_only=True)`` of their byte
  ranges in ``__*.distcp``, as torch's own reader does; ``common.pt`` is never read.
- The tensors are the global (TP1) Megatron tensors under NeMo's names
  (``module.decoder.layers.self_attention.linear_qkv.weight`` ...), every per-layer tensor
  stacked on a leading layer axis and stored one chunk per layer (per TP shard). They go
  through the weight table as a TP1 x PP1 transformer-engine layout, so
  :class:`Nemo2Reader` is a ``shards.ShardedReader`` whose shard tensors come from the
  DCP chunks of one layer at a time.

Writing (``backends/megatron/nemo2_writer.write_nemo2``, in the backend because it needs
megatron-core) uses megatron-core's own ``dist_checkpointing.save`` with
NeMo's key names (one ShardedTensor per layer, the ``_extra_state`` objects NeMo's modules
expect) and copies ``context/`` from a NeMo checkpoint of the same model, which is what NeMo
reads the model back with. It holds the whole model in memory (megatron-core's saver takes
the full state dict), unlike the HF export.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Optional, Tuple

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


def nemo_key(local: str, prefix: str = NEMO_PREFIX) -> Tuple[str, Optional[int]]:
    """A TP1 (transformer-engine names) local parameter -> (DCP fqn, layer index or None):
    megatron-core's ``TransformerBlock.sharded_state_dict`` stacks a homogeneous block's
    layers on a leading axis under one key (``decoder.layers.<rest>``). ``prefix``: NeMo's
    "module.", or "" for Megatron-LM / Megatron-Bridge (the model's own keys)."""
    parts = local.split(".")
    if parts[:2] == ["decoder", "layers"]:
        return prefix + "decoder.layers." + ".".join(parts[3:]), int(parts[2])
    return prefix + local, None


_LOCAL_SPEC_NAMES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}


class Nemo2Reader(ShardedReader):
    """``shards.ShardedReader`` over a megatron-core torch_dist checkpoint (NeMo 2's
    ``weights/``, a Megatron-LM / Megatron-Bridge ``iter_XXXXXXX/``): a TP1 x PP1
    transformer-engine layout whose local tensors are read from the DCP chunks of one layer.
    ``prefix``: the keys' prefix; ``config_name``: where the model's shape came from (errors)."""

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

    def fqn(self, local: str) -> Tuple[str, Optional[int]]:
        fqn, layer = nemo_key(local, self.prefix_key)
        if fqn not in self.index.tensors:  # a checkpoint saved with the local spec's own names
            for te, plain in _LOCAL_SPEC_NAMES.items():
                alt = fqn.replace(te, plain)
                if alt in self.index.tensors:
                    return alt, layer
        return fqn, layer

    def check(self) -> torch.dtype:
        """Every tensor the table needs is indexed with the shape config says; returns the
        stored dtype."""
        dtypes = set()
        for local in local_names(self.spec, self.saved):
            fqn, layer = self.fqn(local)
            if fqn not in self.index.tensors:
                raise ConfigError(
                    f"{str(self.index.weights / '.metadata')!r} holds no tensor {fqn!r} (not a "
                    f"{self.spec.architecture} checkpoint?)"
                )
            shape, dtype = self.index.tensors[fqn]
            want = local_shape(local, self.spec, self.saved)
            if layer is not None:
                want = (self.spec.num_layers,) + want
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

    def _tensor(self, tp_rank: int, stage: int, key: str) -> torch.Tensor:
        fqn, layer = self.fqn(key)
        if fqn not in self.index.tensors:
            raise ConfigError(f"{str(self.index.weights / '.metadata')!r} holds no tensor {fqn!r}")
        return self.index.read(fqn, layer)


def open_nemo2_weights(folder: Path, spec: ModelSpec) -> Tuple[Nemo2Reader, torch.dtype]:
    """A NeMo 2 folder's weights (``weights/``) checked against ``spec``: (reader, stored dtype)."""
    return open_dcp_weights(folder / "weights", spec, NEMO_PREFIX, "context/model.yaml")


def open_dcp_weights(
    weights: Path, spec: ModelSpec, prefix: str, config_name: str
) -> Tuple[Nemo2Reader, torch.dtype]:
    """The GPT weights of the torch_dist folder ``weights`` under keys ``prefix`` + the
    model's own names, checked against ``spec`` (from ``config_name``); the padded
    vocabulary is the stored embedding's rows. Returns (reader, stored dtype)."""
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
    """What the Megatron backend reads besides the weights, for a NeMo 2 training start, as
    an HF-style folder ``dst``: config.json (from context/model.yaml), the tokenizer files of
    context/nemo_tokenizer/ and context/artifacts/generation_config.json when present."""
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
