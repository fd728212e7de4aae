"""``nemo-d3s-convert verify``: logits of a few fixed prompts, transformers on the HF folder
vs the checkpoint converted in memory; a one-line verdict. One model is in memory at a time.
"""

from __future__ import annotations

import gc
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence

import torch

from nemo_d3s.backends.hf.loading import copy_hf_weights
from nemo_d3s.convert.sources import (
    CheckpointSource,
    parse_dtype,
    find_root,
    resolve_hf,
    check_same_model,
    open_checkpoint,
)
from nemo_d3s.errors import ConfigError
from nemo_d3s.formats.detect import MEGATRON_LM, NEMO2, detect_format
from nemo_d3s.formats.safetensors_stream import check_safetensors_folder
from nemo_d3s.formats.spec import ModelSpec

__all__ = ["VERIFY_PROMPTS", "VerifyResult", "verify"]

# Prompts of verify(): short, different kinds of text.
VERIFY_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n",
    "Question: what is 12 + 30? Answer:",
    "Once upon a time, in a small village,",
)


@dataclass
class VerifyResult:
    """Logits of ``prompts`` prompts (``tokens`` positions in all): the HF folder vs the
    checkpoint; ``ok`` when ``max_abs_err <= atol``."""

    ok: bool
    max_abs_err: float
    atol: float
    prompts: int
    tokens: int
    layout: str

    def verdict(self) -> str:
        word = "OK" if self.ok else "MISMATCH"
        return (
            f"{word}: max abs logit error {self.max_abs_err:.3g} (tolerance {self.atol:g}) "
            f"over {self.prompts} prompts / {self.tokens} tokens, checkpoint {self.layout}"
        )


def _logits(model, ids: List[torch.Tensor]) -> List[torch.Tensor]:
    with torch.no_grad():
        return [model(input_ids=x.unsqueeze(0)).logits[0].float() for x in ids]


def _hf_model_from_checkpoint(src: CheckpointSource, dtype: torch.dtype):
    """The transformers model of ``src``'s config with the checkpoint's weights, filled in
    tensor by tensor (no second copy of the model, no file written)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers 4.x
        from transformers.modeling_utils import no_init_weights

    cfg = src.hf_config()
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    try:
        copy_hf_weights(model, src.iter_hf(), tie_word_embeddings=src.spec.tie_word_embeddings)
    except KeyError as e:
        raise ConfigError(f"the checkpoint does not fit transformers' model: {e.args[0]}") from None
    return model.eval()


def verify(
    hf: str | os.PathLike,
    ckpt_path: str | os.PathLike,
    *,
    hf_config: Optional[str | os.PathLike] = None,
    atol: float = 1e-4,
    dtype: str = "float32",
    prompts: Sequence[str] = VERIFY_PROMPTS,
    verify_checksums: bool = True,
) -> VerifyResult:
    """Logits of transformers on ``hf`` against the checkpoint converted in memory (config from
    ``hf_config``, the checkpoint folder or ``hf``), both in ``dtype``, one model in memory at a
    time; the safetensors files and the checkpoint's checksums are checked first.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_dir = resolve_hf(hf)
    spec = ModelSpec.from_folder(hf_dir)
    check_safetensors_folder(hf_dir)
    path = Path(ckpt_path).expanduser()
    cfg_dir = hf_config
    # a Megatron training or converted checkpoint: its own config.json, else the HF folder's
    # (NeMo 2 and Megatron-LM / Megatron-Bridge saves describe their model themselves)
    if cfg_dir is None and detect_format(path).kind not in (NEMO2, MEGATRON_LM):
        folder = find_root(path).folder
        cfg_dir = folder if (folder / "config.json").is_file() else hf_dir
    src = open_checkpoint(path, cfg_dir, verify_checksums=verify_checksums)
    check_same_model(spec, src.spec, f"{str(hf_dir)!r}", f"{str(src.folder)!r}", ignore=src.ignored)
    compute = parse_dtype(dtype) or torch.float32
    tok = AutoTokenizer.from_pretrained(str(hf_dir), local_files_only=True)
    ids = []
    for p in prompts:
        x = torch.tensor(tok(p)["input_ids"], dtype=torch.long)
        ids.append(x.clamp(max=spec.vocab_size - 1))
    model = AutoModelForCausalLM.from_pretrained(
        str(hf_dir), dtype=compute, local_files_only=True
    ).eval()
    want = _logits(model, ids)
    del model
    gc.collect()
    model = _hf_model_from_checkpoint(src, compute)
    got = _logits(model, ids)
    del model
    gc.collect()
    err = max(float((a - b).abs().max()) for a, b in zip(got, want))
    ok = math.isfinite(err) and err <= atol
    return VerifyResult(
        ok=ok,
        max_abs_err=err,
        atol=atol,
        prompts=len(ids),
        tokens=sum(len(x) for x in ids),
        layout=src.layout,
    )
