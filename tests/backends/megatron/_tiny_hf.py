"""Tiny Hugging Face model folders for the Megatron backend tests: random Llama (GQA,
untied), Qwen2 (q/k/v bias, tied) and Qwen3 (q/k RMS norms, no bias, head_dim 16 != hidden /
heads, either tying) with a vocabulary (300) that the Megatron layout must
pad, saved with transformers' own ``save_pretrained`` plus the in-memory byte-level
tokenizer (259 ids), so both backends load the same files; and the GRPO batch the backend
tests train on (:func:`tiny_batch`)."""

from __future__ import annotations

from pathlib import Path

import torch


def make_tiny_hf(
    folder,
    arch: str = "llama",
    *,
    tied: bool = False,
    vocab: int = 300,
    hidden: int = 32,
    ffn: int = 48,
    layers: int = 4,
    heads: int = 4,
    kv_heads: int = 2,
    seed: int = 0,
    experts: int = 4,
    head_dim: int = 16,
) -> Path:
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    from nemo_d3s.backends.hf.loading import byte_level_tokenizer

    folder = Path(folder)
    tok = byte_level_tokenizer()
    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
        initializer_range=0.2,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
    )
    if arch == "llama":
        cfg, cls = LlamaConfig(**common), LlamaForCausalLM
    elif arch == "qwen2":
        cfg, cls = Qwen2Config(**common, use_sliding_window=False), Qwen2ForCausalLM
    elif arch == "qwen3":  # head_dim set apart from hidden / heads, as Qwen3's configs do
        cfg = Qwen3Config(
            **common, head_dim=head_dim, use_sliding_window=False, attention_bias=False
        )
        cls = Qwen3ForCausalLM
    elif arch in MOE:
        cfg, cls = _moe_config(arch, common, experts, head_dim)
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = cls(cfg)
    with torch.no_grad():  # norms away from 1 and non-zero biases, so a mapping slip shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    model.save_pretrained(str(folder))
    tok.save_pretrained(str(folder))
    return folder


MOE = ("qwen3_moe", "qwen3_moe_norm", "mixtral", "qwen2_moe")


def _moe_config(arch: str, common: dict, experts: int, head_dim: int = 16):
    """A mixture-of-experts config over ``common``: Qwen3-MoE (top-2 of ``experts``, expert
    width 24 != the dense 48, ``head_dim`` (16); "qwen3_moe_norm" renormalises the top-k
    probabilities, "qwen3_moe" does not), Mixtral (top-2, expert width = intermediate) or
    Qwen2-MoE (Qwen3-MoE's experts without q/k norms, q/k/v biases, and a shared expert of
    width 40 behind its sigmoid gate)."""
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    if arch == "qwen2_moe":
        from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

        cfg = Qwen2MoeConfig(
            **common,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=40,
            num_experts=experts,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            use_sliding_window=False,
        )
        return cfg, Qwen2MoeForCausalLM
    if arch == "mixtral":
        return MixtralConfig(**common, num_local_experts=experts, num_experts_per_tok=2), (
            MixtralForCausalLM
        )
    cfg = Qwen3MoeConfig(
        **common,
        head_dim=head_dim,
        moe_intermediate_size=24,
        num_experts=experts,
        num_experts_per_tok=2,
        norm_topk_prob=arch == "qwen3_moe_norm",
        use_sliding_window=False,
    )
    return cfg, Qwen3MoeForCausalLM


# The backend tests' batch: 6 rows x 12 tokens of unequal lengths, prompts of 2-5 tokens.
B, S = 6, 12
LENGTHS = [12, 7, 9, 4, 8, 11]
PROMPT = [3, 2, 4, 2, 3, 5]


def tiny_batch(lengths=LENGTHS, prompt=PROMPT, width: int = S, vocab: int = 256, seed: int = 5):
    """(TokenBatch [B, width], advantages [B], old-log-prob noise [B, width], token_keep
    [B, width]) for rows of ``lengths`` tokens with ``prompt``-token prompts; rows 2 and 3
    (micro-batch 1 at micro-batch size 2) keep no token.

    Token ids below ``vocab``; the default 256 = byte tokens only: transformers builds the
    embedding with padding_idx = the pad token (256), whose input row then never gets a
    gradient; Megatron's embedding has no such exception. Rollouts hold the pad id only where
    nothing is attended."""
    from nemo_d3s.backends.base import TokenBatch

    rows = len(lengths)
    g = torch.Generator().manual_seed(seed)
    pos = torch.arange(width)
    attn = pos < torch.tensor(lengths).unsqueeze(1)
    resp = attn & (pos >= torch.tensor(prompt).unsqueeze(1))
    ids = torch.randint(0, vocab, (rows, width), generator=g) * attn
    adv = torch.randn(rows, generator=g)
    noise = 0.2 * torch.randn(rows, width, generator=g)
    keep = resp & (torch.rand(rows, width, generator=g) < 0.6)
    keep[2:4] = False
    keep[0, prompt[0]] = keep[5, prompt[5]] = True
    return TokenBatch(ids, attn, resp), adv, noise, keep
