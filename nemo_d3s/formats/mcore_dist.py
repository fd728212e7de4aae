"""Megatron-LM / Megatron-Bridge / NeMo-RL checkpoints (torch_dist): their GPT weights and the
side folder a training start needs. Tensors are stored by global shape whatever the saving
layout, layers stacked on a leading axis, under the model's own keys (transformer-engine
names); that is NeMo 2's ``weights/`` without "module.", so :class:`nemo2.Nemo2Reader` reads
both. The optimizer state is not read.
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
    """The GPT weights of one ``iter_XXXXXXX/`` folder checked against ``spec``; a NeMo 2
    ``weights/`` reads too ("module." keys).
    """
    index = DcpIndex(folder)
    prefix = "" if "embedding.word_embeddings.weight" in index.tensors else NEMO_PREFIX
    return open_dcp_weights(folder, spec, prefix, config_name)


def write_side_folder(folder: Path, dst: Path, hf_config: Optional[Path] = None) -> Path:
    """The HF-style folder ``dst`` a training start from ``folder`` reads besides the weights:
    config.json (``hf_config``'s, else the checkpoint's) and tokenizer files (Megatron-Bridge's
    ``tokenizer/``, else ``hf_config``'s).
    """
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
