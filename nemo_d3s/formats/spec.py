"""A Hugging Face ``config.json`` (or NeMo 2 ``context/model.yaml``) -> :class:`ModelSpec`, the
one description of the model the Megatron backend, the weight table, the converter and the
dry run use. JSON only (``trust_remote_code`` is refused); plain Python, no torch. Supports
Llama, Mistral (no sliding window), Qwen2 and dense Qwen3; anything the mapping would get
silently wrong is a ConfigError naming the field.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Dict, Optional

from nemo_d3s.errors import ConfigError
from nemo_d3s.formats.detect import MEGATRON_LM, NEMO2, detect_format
from nemo_d3s.formats.moe import moe_fields
from nemo_d3s.formats.nemo2_context import LLAMA3_FIXED, hf_config_from_nemo

__all__ = [
    "ModelSpec",
    "SUPPORTED_ARCHITECTURES",
    "QK_NORM_ARCHITECTURES",
    "check_expert_layout",
    "check_layout",
    "padded_vocab_size",
    "read_hf_config",
]

# architecture -> whether q/k/v carry a bias by construction (Qwen2 always does).
SUPPORTED_ARCHITECTURES: Dict[str, bool] = {
    "LlamaForCausalLM": False,
    "MistralForCausalLM": False,
    "Qwen2ForCausalLM": True,
    "Qwen3ForCausalLM": False,
    "Qwen3MoeForCausalLM": False,
    "MixtralForCausalLM": False,
    "Qwen2MoeForCausalLM": False,  # its config's qkv_bias (default true)
}
# architectures whose attention normalises every query and key head (RMS norm over
# head_dim, one weight per width shared by the heads) before RoPE: Megatron's qk_layernorm.
QK_NORM_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only HF model in the Megatron backend's terms.

    vocab_size: the real vocabulary (:func:`padded_vocab_size` pads beyond it); kv_heads: GQA
    query groups; head_dim: Megatron's ``kv_channels``; rope_scaling_factor: Llama 3.x (None:
    none); torch_dtype: the saved dtype; qk_norm: RMS norm [head_dim] per query / key head (Qwen3).
    Mixture of experts (``formats/moe.py``; 0 experts = dense): num_experts,
    moe_ffn_hidden_size (one expert's width), moe_topk (experts per token), moe_pre_softmax
    (top-k of the softmax over all experts, not renormalised), moe_shared_ffn_hidden_size
    (the width of a shared expert every token goes through, scaled by a sigmoid gate:
    Qwen2-MoE; 0 = none).
    """

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_heads: int
    kv_heads: int
    head_dim: int
    norm_eps: float
    rope_theta: float
    rope_scaling_factor: Optional[float]
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    torch_dtype: str = "float32"
    qk_norm: bool = False
    num_experts: int = 0
    moe_ffn_hidden_size: int = 0
    moe_topk: int = 0
    moe_pre_softmax: bool = False
    moe_shared_ffn_hidden_size: int = 0

    @classmethod
    def from_hf_dict(cls, cfg: Dict[str, Any], source: str = "config.json") -> "ModelSpec":
        """Validate an HF config dict (``source`` names it in errors) and map it."""

        def need(key: str, kind=int):
            if key not in cfg:
                raise ConfigError(f"{source}: missing {key!r}")
            v = cfg[key]
            if kind is int and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ConfigError(f"{source}: {key}={v!r} must be a positive integer")
            if kind is float and (
                isinstance(v, bool)
                or not isinstance(v, (int, float))
                or not math.isfinite(v)
                or v <= 0
            ):
                raise ConfigError(f"{source}: {key}={v!r} must be a positive number")
            return v

        archs = cfg.get("architectures") or []
        if (
            not isinstance(archs, list)
            or len(archs) != 1
            or archs[0] not in SUPPORTED_ARCHITECTURES
        ):
            raise ConfigError(
                f"{source}: architectures={archs!r} is not supported by the Megatron backend; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        arch = archs[0]
        if cfg.get("auto_map"):
            raise ConfigError(
                f"{source}: auto_map (remote code) is not supported; the mapping covers {arch} only"
            )
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(
                f"{source}: hidden_act={act!r} is not supported (SwiGLU with silu only)"
            )
        if cfg.get("quantization_config") is not None:  # FP8 / int weights: scales not mapped
            raise ConfigError(
                f"{source}: quantization_config is set: quantized checkpoints are not supported "
                "(use the model's bfloat16 / float32 release)"
            )
        if cfg.get("mlp_bias"):
            raise ConfigError(f"{source}: mlp_bias=true is not supported")
        sliding = cfg.get("sliding_window")
        if arch in (
            "Qwen2ForCausalLM",
            "Qwen3ForCausalLM",
            "Qwen3MoeForCausalLM",
            "Qwen2MoeForCausalLM",
        ):
            sliding = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
        if sliding is not None:
            raise ConfigError(
                f"{source}: sliding_window={sliding!r} is not supported (full causal "
                "attention only)"
            )
        hidden, heads = need("hidden_size"), need("num_attention_heads")
        kv = cfg.get("num_key_value_heads", heads)
        if kv is None:
            kv = heads
        if isinstance(kv, bool) or not isinstance(kv, int) or kv < 1 or heads % kv:
            raise ConfigError(
                f"{source}: num_key_value_heads={kv!r} must divide num_attention_heads={heads}"
            )
        head_dim = cfg.get("head_dim") or hidden // heads
        if not isinstance(head_dim, int) or head_dim < 1 or head_dim % 2:
            raise ConfigError(f"{source}: head_dim={head_dim!r} must be a positive even integer")
        if cfg.get("head_dim") is None and hidden % heads:
            raise ConfigError(
                f"{source}: hidden_size={hidden} is not a multiple of num_attention_heads={heads}"
            )
        qkv_bias = SUPPORTED_ARCHITECTURES[arch] or bool(cfg.get("attention_bias", False))
        if arch == "Qwen2MoeForCausalLM":
            qkv_bias = bool(cfg.get("qkv_bias", True))
        theta, factor = _rope(cfg, source)
        dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
        if dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(
                f"{source}: torch_dtype={dtype!r} is not one of float32, bfloat16, float16"
            )
        return cls(
            architecture=arch,
            model_type=str(cfg.get("model_type", "")),
            vocab_size=need("vocab_size"),
            hidden_size=hidden,
            ffn_hidden_size=need("intermediate_size"),
            num_layers=need("num_hidden_layers"),
            num_heads=heads,
            kv_heads=kv,
            head_dim=head_dim,
            norm_eps=float(need("rms_norm_eps", float)),
            rope_theta=theta,
            rope_scaling_factor=factor,
            max_position_embeddings=need("max_position_embeddings"),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            torch_dtype=dtype,
            qk_norm=arch in QK_NORM_ARCHITECTURES,
            **moe_fields(cfg, arch, source, need),
        )

    @classmethod
    def from_folder(cls, folder: str | Path) -> "ModelSpec":
        """From ``folder/config.json``, a NeMo 2 checkpoint's ``context/model.yaml``, or a
        Megatron-LM / Megatron-Bridge checkpoint's own description (``mcore_config``)."""
        kind = detect_format(folder).kind
        if kind == NEMO2:
            return cls.from_hf_dict(
                hf_config_from_nemo(folder), str(Path(folder) / "context" / "model.yaml")
            )
        if kind == MEGATRON_LM:
            from nemo_d3s.formats.mcore_config import checkpoint_hf_config, resolve_iteration

            return cls.from_hf_dict(*checkpoint_hf_config(resolve_iteration(folder)))
        return cls.from_hf_dict(read_hf_config(folder), str(Path(folder) / "config.json"))

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)

    @property
    def num_params(self) -> int:
        """Parameters of the HF model (real vocabulary; tied embeddings counted once)."""
        h, d = self.hidden_size, self.head_dim
        attn = h * d * (self.num_heads + 2 * self.kv_heads) + self.num_heads * d * h
        if self.qkv_bias:
            attn += d * (self.num_heads + 2 * self.kv_heads)
        if self.qk_norm:
            attn += 2 * d
        layer = attn + self._mlp_params(self.num_experts) + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * layer + emb + h

    @property
    def active_params(self) -> int:
        """Parameters one token goes through: :attr:`num_params` with ``moe_topk`` of the
        experts (the router counted whole); = num_params for a dense model."""
        unused = self._mlp_params(self.num_experts) - self._mlp_params(self.moe_topk)
        return self.num_params - self.num_layers * unused

    def _mlp_params(self, experts: int) -> int:
        """One layer's MLP with ``experts`` experts (+ the router) or the dense MLP."""
        h = self.hidden_size
        if not self.num_experts:
            return 3 * h * self.ffn_hidden_size
        shared = (
            3 * h * self.moe_shared_ffn_hidden_size + h if self.moe_shared_ffn_hidden_size else 0
        )
        return self.num_experts * h + experts * 3 * h * self.moe_ffn_hidden_size + shared


def _rope(cfg: Dict[str, Any], source: str):
    """(rope_theta, llama3 scaling factor or None) from either transformers' 5.x
    ``rope_parameters`` or the older top-level ``rope_theta`` / ``rope_scaling``."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        theta, scaling, where = params.get("rope_theta"), params, "rope_parameters"
    else:
        theta, scaling, where = (
            cfg.get("rope_theta", 10000.0),
            cfg.get("rope_scaling"),
            "rope_scaling",
        )
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
        raise ConfigError(f"{source}: rope_theta={theta!r} must be a positive number")
    if not scaling:
        return float(theta), None
    if not isinstance(scaling, dict):
        raise ConfigError(f"{source}: {where}={scaling!r} must be an object")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return float(theta), None
    if kind != "llama3":
        raise ConfigError(
            f"{source}: {where}.rope_type={kind!r} is not supported (default or llama3)"
        )
    for key, want in LLAMA3_FIXED.items():
        if float(scaling.get(key, want)) != want:
            raise ConfigError(
                f"{source}: {where}.{key}={scaling.get(key)!r}: megatron-core's llama3 "
                f"RoPE scaling fixes it to {want}"
            )
    factor = scaling.get("factor")
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
        raise ConfigError(f"{source}: {where}.factor={factor!r} must be a positive number")
    return float(theta), float(factor)


def read_hf_config(folder: str | Path) -> Dict[str, Any]:
    """``folder/config.json`` as a dict; clear errors for a missing or garbled file."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ConfigError(
            f"{str(path)!r} not found: model.name must be a Hugging Face model folder"
        )
    try:
        cfg = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{str(path)!r} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{str(path)!r} must hold a JSON object")
    return cfg


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """Vocabulary rounded up to a multiple of ``divisible_by x TP`` (equal, aligned TP shards);
    rows past ``vocab_size`` are never sampled, scored or exported.
    """
    m = divisible_by * tp
    return -(-vocab_size // m) * m


def smallest_world(tp: int, pp: int, ep: int = 1, etp: Optional[int] = None) -> int:
    """The fewest ranks a TP x PP layout with EP x ETP experts (ETP None: TP) runs on: TP x PP
    and ETP x EP x PP must both divide it (``check_layout``), so lcm(TP, ETP x EP) x PP (not
    the max: TP 2 with EP 3 needs 6 ranks, not 3). Sizes < 1 give 1 here: ``check_layout``
    names them."""
    etp = tp if etp is None else etp
    return math.lcm(max(int(tp), 1), max(int(etp) * int(ep), 1)) * max(int(pp), 1)


def check_layout(
    spec: ModelSpec,
    *,
    tp: int,
    pp: int,
    world: int,
    cp: int = 1,
    vpp: int = 1,
    ep: int = 1,
    etp: Optional[int] = None,
    pp_last: bool = True,
) -> int:
    """DP of a TP x PP (x CP, x VPP, x EP with ETP: ``check_expert_layout``) layout of ``spec``
    on ``world`` ranks; ConfigError with the numbers for any broken divisibility rule (pure
    arithmetic: every rank raises alike).
    """
    for name, v in (
        ("tensor_model_parallel_size", tp),
        ("pipeline_model_parallel_size", pp),
        ("context_parallel_size", cp),
        ("virtual_pipeline_model_parallel_size", vpp),
    ):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"model.params.{name}={v!r} must be an integer >= 1")
    if world % (tp * pp * cp):
        raise ConfigError(
            f"world size {world} is not divisible by tensor_model_parallel_size x "
            f"pipeline_model_parallel_size{' x context_parallel_size' if cp > 1 else ''} = "
            f"{tp * pp * cp}"
        )
    if spec.num_heads % tp:
        raise ConfigError(
            f"num_attention_heads={spec.num_heads} is not divisible by "
            f"tensor_model_parallel_size={tp}"
        )
    if spec.kv_heads % tp:
        raise ConfigError(
            f"num_key_value_heads={spec.kv_heads} is not divisible by "
            f"tensor_model_parallel_size={tp} (replicating key/value heads across TP ranks "
            "is not supported)"
        )
    if not spec.num_experts and spec.ffn_hidden_size % tp:
        raise ConfigError(
            f"intermediate_size={spec.ffn_hidden_size} is not divisible by "
            f"tensor_model_parallel_size={tp}"
        )
    if spec.num_layers % pp:
        raise ConfigError(
            f"num_hidden_layers={spec.num_layers} is not divisible by "
            f"pipeline_model_parallel_size={pp}"
        )
    if spec.num_layers % (pp * vpp):
        raise ConfigError(
            f"num_hidden_layers={spec.num_layers} is not divisible by "
            "pipeline_model_parallel_size x virtual_pipeline_model_parallel_size = "
            f"{pp * vpp}"
        )
    dp = world // (tp * pp * cp)
    check_expert_layout(spec, tp=tp, pp=pp, world=world, dp=dp, ep=ep, etp=etp, pp_last=pp_last)
    return dp


def check_expert_layout(
    spec: ModelSpec,
    *,
    tp: int,
    pp: int,
    world: int,
    dp: int,
    ep: int = 1,
    etp: Optional[int] = None,
    pp_last: bool = True,
) -> None:
    """The rules megatron-core 0.16.1 enforces on an expert layout, stated before start:
    EP > 1 needs experts (transformer_config.py:1048), EP must divide them, ETP (None: TP,
    model_parallel_config.py:413-414) the expert width, ETP x EP x PP the world
    (parallel_state.py:788-795), and with a rank order that does not end in PP the expert
    data-parallel size must equal DP (parallel_state.py:808-812)."""
    etp = tp if etp is None else etp
    for name, v in (("expert_model_parallel_size", ep), ("expert_tensor_parallel_size", etp)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"model.params.{name}={v!r} must be an integer >= 1")
    if not spec.num_experts:
        if ep > 1:
            raise ConfigError(
                f"model.params.expert_model_parallel_size={ep}: {spec.architecture} has no experts"
            )
        return
    if spec.num_experts % ep:
        raise ConfigError(
            f"num_experts={spec.num_experts} is not divisible by expert_model_parallel_size={ep}"
        )
    if spec.moe_ffn_hidden_size % etp:
        raise ConfigError(
            f"moe_intermediate_size={spec.moe_ffn_hidden_size} is not divisible by "
            f"expert_tensor_parallel_size={etp}"
        )
    if spec.moe_shared_ffn_hidden_size % tp:  # the shared expert splits like the dense MLP
        raise ConfigError(
            f"shared_expert_intermediate_size={spec.moe_shared_ffn_hidden_size} is not "
            f"divisible by tensor_model_parallel_size={tp}"
        )
    if world % (etp * ep * pp):
        raise ConfigError(
            f"world size {world} is not divisible by expert_tensor_parallel_size x "
            f"expert_model_parallel_size x pipeline_model_parallel_size = {etp * ep * pp}"
        )
    if not pp_last and pp > 1 and world // (etp * ep * pp) != dp:
        raise ConfigError(
            f"use_tp_pp_dp_mapping with pipeline_model_parallel_size={pp}: megatron-core needs "
            f"expert_tensor_parallel_size x expert_model_parallel_size = {etp * ep} to equal "
            f"tensor_model_parallel_size = {tp} (the same data-parallel size for experts)"
        )
