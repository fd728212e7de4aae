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
    """Everything :class:`HFBackend` needs to build a policy, its optimizer and reference.

    model: "tiny-random" (random Llama from ``tiny``), "smollm2-135m-instruct" (the embedded
        default, converted from GGUF once and cached), or a local Hugging Face folder.
    dtype: parameter dtype: "float32", "bfloat16", "float16" or "auto" (= float32). AdamW
        keeps its moments in the parameter dtype, so bfloat16 parameters trade update
        precision (and log-prob ratio precision) for memory.
    autocast: "bfloat16" runs forwards under torch.autocast while parameters and optimizer
        stay in ``dtype`` (mixed precision); "auto" = bfloat16 on CUDA, off on CPU; None = off.
    scheduler: "constant", "linear" or "cosine" decay after ``warmup_steps`` of linear warm-up;
        the decaying ones need ``total_steps``.
    grad_clip: max global grad norm; <= 0 disables clipping (the norm is still reported).
    generation_batch_size: rows decoded together (None = all rows of the call at once).
    sampler: "seeded" (default): the backend's own KV-cache sampling loop, each (prompt,
        sample) drawing from a private seed, so samples do not depend on the batch layout
        (a data-parallel run samples what a one-process run samples); "hf_generate":
        ``model.generate`` seeded once per call (transformers' sampling, layout-dependent).
    stop_tokens: extra tokens that end a response like EOS, when the tokenizer has them as
        single tokens. ChatML models (SmolLM2) sometimes close a turn by opening the next
        one ("<|im_start|>") instead of "<|im_end|>"; without this the sample runs on into
        an invented dialogue.
    use_chat_template: wrap each prompt as one user turn with the tokenizer's chat template
        (when it has one); False feeds the raw prompt text.
    dist_timeout_minutes: how long a collective waits for a peer rank before the process
        group fails (None = torch's default, 30 minutes); used when this backend creates
        the process group under torchrun.
    """

    model: str = "tiny-random"
    tiny: TinyModelSpec = field(default_factory=TinyModelSpec)
    autocast: Optional[str] = "auto"
    attn_implementation: Optional[str] = "sdpa"
