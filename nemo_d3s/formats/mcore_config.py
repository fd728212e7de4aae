"""What a Megatron-LM / Megatron-Bridge / NeMo-RL save folder says about its model: the
checkpoint its tracker (``latest_checkpointed_iteration.txt``) names (``iter_000000N/`` or
``release/``: ``metadata.json``, torch DCP files, ``common.pt`` up to megatron-core 0.18 or a
DCP byte item from 0.19) and the model's HF config dict. The architecture comes from
``--hf-config`` when given, else Megatron-Bridge's ``run_config.yaml`` ``model:``, else
Megatron-LM's ``args`` in the common state (no pickled code runs), mapped by
``nemo2_context.hf_config_from_transformer_config``; without ``--vocab-size`` in the args,
``--hf-config`` is needed.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

from nemo_d3s.errors import ConfigError
from nemo_d3s.formats.detect import DIST_MARKERS as _MARKERS
from nemo_d3s.formats.detect import TRACKER
from nemo_d3s.formats.dcp_index import DcpIndex
from nemo_d3s.formats.nemo2_context import hf_config_from_transformer_config
from nemo_d3s.formats.pickle_records import read_common_pt

__all__ = [
    "RUN_CONFIG",
    "resolve_iteration",
    "checkpoint_hf_config",
    "megatron_lm_args",
    "common_state",
    "tokenizer_folder",
]

RUN_CONFIG = "run_config.yaml"


def resolve_iteration(path: str | os.PathLike) -> Path:
    """The checkpoint folder of ``path``: itself, or the one its tracker names. ConfigError
    naming the tracker when it is garbled or names a folder that is not there."""
    p = Path(path)
    if all((p / m).is_file() for m in _MARKERS):
        return p
    tracker = p / TRACKER
    try:
        text = tracker.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{str(tracker)!r} is unreadable ({e})") from None
    if text == "release":
        it = p / "release"
    elif text.isdigit():
        it = p / f"iter_{int(text):07d}"
    else:
        raise ConfigError(
            f"{str(tracker)!r} holds {text[:40]!r}: neither an iteration number nor 'release'"
        )
    missing = [m for m in _MARKERS if not (it / m).is_file()]
    if missing:
        raise ConfigError(
            f"{str(tracker)!r} names {str(it)!r}, which is not a torch_dist checkpoint "
            f"(missing {', '.join(missing)}); pass one iter_XXXXXXX folder instead"
        )
    return it


def _yaml_model_section(path: Path) -> Dict[str, Any]:
    import yaml

    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise ConfigError(f"{str(path)!r} is not valid YAML: {str(e).splitlines()[0]}") from None
    model = data.get("model") if isinstance(data, dict) else None
    if not isinstance(model, dict):
        raise ConfigError(f"{str(path)!r} holds no 'model:' mapping (the model provider)")
    return model


# Megatron-LM's argument names -> the TransformerConfig / GPTModel field they set
_ARGS = {
    "num_layers": "num_layers",
    "hidden_size": "hidden_size",
    "ffn_hidden_size": "ffn_hidden_size",
    "num_attention_heads": "num_attention_heads",
    "kv_channels": "kv_channels",
    "norm_epsilon": "layernorm_epsilon",
    "normalization": "normalization",
    "swiglu": "gated_linear_unit",
    "add_bias_linear": "add_bias_linear",
    "add_qkv_bias": "add_qkv_bias",
    "qk_layernorm": "qk_layernorm",
    "position_embedding_type": "position_embedding_type",
    "rotary_base": "rotary_base",
    "rotary_percent": "rotary_percent",
    "max_position_embeddings": "seq_length",
    "vocab_size": "vocab_size",
    "params_dtype": "params_dtype",
    "bf16": "bf16",
    "use_rope_scaling": "rope_scaling",
    "rope_scaling_factor": "rope_scaling_factor",
    "num_experts": "num_moe_experts",
    "moe_ffn_hidden_size": "moe_ffn_hidden_size",
    "moe_router_topk": "moe_router_topk",
    "moe_router_pre_softmax": "moe_router_pre_softmax",
    "moe_router_score_function": "moe_router_score_function",
    "moe_layer_freq": "moe_layer_freq",
    "moe_router_enable_expert_bias": "moe_router_enable_expert_bias",
    "moe_router_num_groups": "moe_router_num_groups",
    "moe_router_topk_scaling_factor": "moe_router_topk_scaling_factor",
    "moe_shared_expert_intermediate_size": "moe_shared_expert_intermediate_size",
    "moe_shared_expert_gate": "moe_shared_expert_gate",
    "multi_latent_attention": "multi_latent_attention",
    "init_method_std": "init_method_std",
    # refused when set (nemo2_context._MATHS_FIELDS): read so they are not dropped
    "window_size": "window_size",
    "apply_layernorm_1p": "layernorm_zero_centered_gamma",
    "rotary_interleaved": "rotary_interleaved",
    "rotary_seq_len_interpolation_factor": "seq_len_interpolation_factor",
}


# Where dist_checkpointing.save puts the non-sharded state (Megatron-LM's args, iteration...):
# - megatron-core <= 0.18 (0.16.1: serialization.py:411 calls save_common,
#   strategies/common.py:24 and :40-47) torch.save's it as ``common.pt`` beside the DCP files;
# - megatron-core 0.19 (0.19.2: serialization.py:439-445) makes it one ShardedObject
#   ("common_state", global shape (1,), offset (0,): unique key ``common_state/shard_0_1``,
#   mapping.py:397-403) that torch DCP stores as a byte item, the bytes of
#   ``torch.save([state])`` (strategies/torch.py:316-320), indexed by ``.metadata`` like any
#   tensor chunk; its save_common is deprecated (strategies/common.py:20-29) and its loader
#   reads common.pt first when there is one (serialization.py:200-237, :224).
# Both are read here in that order, through the same allow-list unpickler.
COMMON_PT = "common.pt"
COMMON_STATE = "common_state/shard_0_1"


def common_state(folder: Path) -> Tuple[Dict[str, Any], str]:
    """(the checkpoint folder's non-sharded state dict, where it was read: ``common.pt`` or the
    ``.metadata`` byte item); ConfigError naming the file when neither holds a readable dict.
    """
    if (folder / COMMON_PT).is_file():
        where = f"{str(folder / COMMON_PT)!r}"
        data = read_common_pt(folder / COMMON_PT)
    else:
        where = f"{str(folder / '.metadata')!r} common_state"
        index = DcpIndex(folder)
        if COMMON_STATE not in index.objects:
            raise ConfigError(
                f"{where}: {str(folder)!r} holds neither {COMMON_PT} (megatron-core <= 0.18) nor "
                f"a {COMMON_STATE!r} item (0.19): pass --hf-config DIR (the model's HF folder)"
            )
        raw, path = index.read_object(COMMON_STATE)
        items = read_common_pt(path, raw, what=f"{COMMON_STATE!r} item")
        data = items[0] if isinstance(items, list) and len(items) == 1 else items
    if not isinstance(data, dict):
        raise ConfigError(f"{where} holds {type(data).__name__}, not a dict")
    return data, where


def megatron_lm_args(folder: Path) -> Tuple[Dict[str, Any], str]:
    """Megatron-LM's ``args`` namespace of the checkpoint's common state as a dict, and where
    it was read (ConfigError when there is none: a checkpoint written by another tool)."""
    common, where = common_state(folder)
    args = common.get("args")
    if args is None or not hasattr(args, "__dict__"):
        raise ConfigError(
            f"{where} holds no Megatron-LM args and {str(folder)!r} no "
            f"{RUN_CONFIG}: pass --hf-config DIR (the model's HF folder)"
        )
    return {k: v for k, v in vars(args).items() if k != "args"}, where


def _from_args(args: Dict[str, Any]) -> Dict[str, Any]:
    c = {field: args[name] for name, field in _ARGS.items() if args.get(name) is not None}
    c["share_embeddings_and_output_weights"] = not args.get(
        "untie_embeddings_and_output_weights", False
    )
    if args.get("group_query_attention") and args.get("num_query_groups"):
        c["num_query_groups"] = args["num_query_groups"]
    c["activation_func"] = "torch.nn.functional.silu" if args.get("swiglu") else "gelu"
    if "params_dtype" in c:
        c["params_dtype"] = "torch." + str(c["params_dtype"]).replace("torch.", "")
    return c


def checkpoint_hf_config(folder: Path) -> Tuple[Dict[str, Any], str]:
    """(HF config dict, its source) for the checkpoint folder ``folder``: Megatron-Bridge's
    run_config.yaml, else Megatron-LM's args.
    """
    run_config = folder / RUN_CONFIG
    if run_config.is_file():
        model = _yaml_model_section(run_config)
        where = f"{str(run_config)!r} (Megatron-Bridge) model"
        if model.get("vocab_size") is None:
            raise ConfigError(
                f"{where}: vocab_size is not set: pass --hf-config DIR (the model's HF folder)"
            )
        return hf_config_from_transformer_config(model, where), where
    args, common = megatron_lm_args(folder)
    where = f"{common} (Megatron-LM) args"
    c = _from_args(args)
    if c.get("vocab_size") is None:
        raise ConfigError(
            f"{where}: vocab_size is not set (the run padded its tokenizer's vocabulary to "
            f"padded_vocab_size={args.get('padded_vocab_size')!r}; the real size is not "
            "recorded): pass --hf-config DIR (the model's HF folder)"
        )
    return hf_config_from_transformer_config(c, where), where


def tokenizer_folder(folder: Path) -> Optional[Path]:
    """Where the checkpoint's HF tokenizer files are: Megatron-Bridge's ``tokenizer/``; else
    None (Megatron-LM keeps none)."""
    tok = folder / "tokenizer"
    return tok if (tok / "tokenizer_config.json").is_file() else None
