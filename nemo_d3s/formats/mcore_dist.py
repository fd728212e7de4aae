"""Megatron-LM / Megatron-Bridge / NeMo-RL checkpoints (megatron-core ``dist_checkpointing``,
torch_dist): their GPT weights and the side folder a training start needs. Where the folder
and the model's description come from: ``mcore_config.py``.

The weights are megatron-core ``GPTModel.sharded_state_dict()`` tensors under the model's own
keys, stored by their GLOBAL shape whatever the TP x PP (x VPP) of the run that saved them:
``embedding.word_embeddings.weight`` [padded vocab, H], ``decoder.layers.<rest>`` with the
layers stacked on a leading axis [L, ...] (``TransformerBlock.sharded_state_dict``, one
chunk per layer per TP shard; the gated fc1 as [gate; up], chunked per TP rank by its swiglu
factory), ``decoder.final_layernorm.weight``, ``output_layer.weight``; transformer-engine
names (``linear_qkv.layer_norm_weight``) also for the local spec, which maps its norms to
them. Megatron-LM nests the model under "model" ("model0", "model1", ... with a virtual
pipeline) and the optimizer under "optimizer", but DCP indexes the tensors by their own keys,
so every layout reads alike; the optimizer state is not read. That is NeMo 2's ``weights/``
without its "module." prefix: :class:`nemo2.Nemo2Reader` reads both (no pickle runs beyond
its metadata unpickler; tensors are ``torch.load(weights_only=True)`` of their byte ranges).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Optional, Tuple

import torch

from nemo_d3s.errors import ConfigError
from nemo_d3s.formats.mcore_config import checkpoint_hf_config, tokenizer_folder
from nemo_d3s.formats.nemo2 import NEMO_PREFIX, Nemo2Reader, DcpIndex, open_dcp_weights
from nemo_d3s.formats.side_files import GENERATION_CONFIG, TOKENIZER_FILES
from nemo_d3s.formats.spec import ModelSpec

__all__ = ["open_mcore_weights", "write_side_folder"]


def open_mcore_weights(
    folder: Path, spec: ModelSpec, config_name: str
) -> Tuple[Nemo2Reader, torch.dtype]:
    """The GPT weights of the checkpoint folder ``folder`` (one ``iter_XXXXXXX/``) checked
    against ``spec`` (from ``config_name``). A NeMo 2 ``weights/`` given on its own reads too
    (its keys carry NeMo's "module." prefix)."""
    index = DcpIndex(folder)
    prefix = "" if "embedding.word_embeddings.weight" in index.tensors else NEMO_PREFIX
    return open_dcp_weights(folder, spec, prefix, config_name)


def write_side_folder(folder: Path, dst: Path, hf_config: Optional[Path] = None) -> Path:
    """What the Megatron backend reads besides the weights, for a training start from the
    checkpoint ``folder``, as an HF-style folder ``dst``: config.json (``hf_config``'s when
    given, else the checkpoint's own description) and the tokenizer files (Megatron-Bridge's
    ``tokenizer/``, else ``hf_config``'s)."""
    if hf_config is not None:
        cfg = json.loads((hf_config / "config.json").read_text(encoding="utf-8"))
    else:
        cfg, _ = checkpoint_hf_config(folder)
    tok = tokenizer_folder(folder) or hf_config
    if tok is None or not (tok / "tokenizer_config.json").is_file():
        raise ConfigError(
            f"{str(folder)!r} holds no tokenizer (Megatron-LM keeps none; Megatron-Bridge keeps "
            "tokenizer/ unless save_tokenizer_assets=false): convert it with nemo-d3s-convert "
            "megatron-to-hf --hf-config DIR first, DIR being the model's HF folder"
        )
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(
        json.dumps(cfg, indent=2, sort_keys=True) + "\n", encoding="utf-8"
    )
    for name in (*TOKENIZER_FILES, GENERATION_CONFIG):  # the converters' one list
        if (tok / name).is_file():
            shutil.copyfile(tok / name, dst / name)
    return dst
