"""Typed configuration of the Hugging Face backend (a Hydra structured-config node)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from nemo_d3s.backends.settings import PolicySettings


@dataclass
class TinyModelSpec:
    """Shape of the random Llama built for ``model="tiny-random"`` (CI and smoke tests).

    ``tokenizer``: "bytes" builds an in-memory byte-level tokenizer (259 ids, no files);
    "smollm2" reuses the SmolLM2 tokenizer (converted from the embedded GGUF on first use).
    """

    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 4
    intermediate_size: int = 128
    max_position_embeddings: int = 1024
    tie_word_embeddings: bool = True
    tokenizer: str = "bytes"


@dataclass
class HFBackendConfig(PolicySettings):
    """Everything :class:`HFBackend` needs (shared settings: ``PolicySettings``).

    model: "tiny-random" (built from ``tiny``), "smollm2-135m-instruct" (embedded) or a local
        HF folder. dtype "auto" = float32 (AdamW moments take the parameter dtype).
    autocast: forwards under torch.autocast ("auto": bfloat16 on CUDA, off on CPU).
    sampler: "seeded" (a private seed per sample: layout-independent) or "hf_generate"
        (``model.generate`` seeded once per call: layout-dependent).
    """

    model: str = "tiny-random"
    tiny: TinyModelSpec = field(default_factory=TinyModelSpec)
    autocast: Optional[str] = "auto"
    attn_implementation: Optional[str] = "sdpa"
