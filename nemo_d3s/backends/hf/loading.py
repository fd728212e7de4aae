"""Building a policy model and tokenizer from local files only (never the Hub), including
the random "tiny-random" Llama with its in-memory byte-level tokenizer."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Dict, Optional, Tuple

import torch

from nemo_d3s.formats.moe import fused_target
from nemo_d3s.formats.side_files import TOKENIZER_MODEL
from nemo_d3s.backends.hf.config import HFBackendConfig, TinyModelSpec
from nemo_d3s.backends.hf.gguf_convert import (
    DEFAULT_MODEL_NAME,
    cache_root,
    convert_gguf,
    ensure_default_model,
    is_complete,
)
from nemo_d3s.formats.safetensors_stream import check_safetensors_folder

TINY_RANDOM = "tiny-random"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# ChatML, the format SmolLM2 uses too, so prompts look alike on both models.
_CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def resolve_model_path(name_or_path: str) -> Path:
    """The folder of a model name, directory or ``.gguf`` file (converted once into the
    cache); FileNotFoundError naming anything else."""
    if name_or_path == DEFAULT_MODEL_NAME:
        return ensure_default_model()
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"model {name_or_path!r}: no such GGUF file ({path.resolve()})")
        return gguf_model_dir(path)
    raise FileNotFoundError(
        f"model {name_or_path!r}: no such directory ({path.resolve()}); give a local "
        f"Hugging Face folder, a .gguf file, {DEFAULT_MODEL_NAME!r} or {TINY_RANDOM!r} "
        "(the Hub is never contacted)"
    )


def gguf_model_dir(gguf: Path) -> Path:
    """The Hugging Face folder of a GGUF file, de-quantised on first use into
    ``<cache>/gguf/<name>-<key>`` (key: the file's path, size and mtime, so an edited file
    is converted again). A file transformers' GGUF reader cannot map -> ValueError naming it."""
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[
        :12
    ]
    out = cache_root() / "gguf" / f"{gguf.stem}-{key}"
    if is_complete(out):
        return out
    try:
        return convert_gguf(gguf, out)
    except Exception as e:  # gguf / transformers raise many types for a file they cannot map
        first = next(
            (line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__
        )
        raise ValueError(
            f"model {str(gguf)!r}: cannot convert this GGUF file into a Hugging Face "
            f"folder ({first}); convert it yourself, or give a Hugging Face folder"
        ) from None


# A tokenizer needs one of these; without any, transformers' error blames a missing
# sentencepiece install.
_TOKENIZER_FILES = TOKENIZER_MODEL  # one of them must be there (formats.side_files)


def load_tokenizer(folder: str):
    """``AutoTokenizer.from_pretrained(folder)`` from local files; a folder without
    tokenizer files -> FileNotFoundError naming it and what it lacks."""
    from transformers import AutoTokenizer

    if not any((Path(folder) / name).is_file() for name in _TOKENIZER_FILES):
        raise FileNotFoundError(
            f"model folder {str(folder)!r} has no tokenizer file "
            f"({', '.join(_TOKENIZER_FILES)}); copy the tokenizer files of the model it "
            "was made from into it"
        )
    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


def folder_generation_config(folder: str):
    """The generation config a model loaded from ``folder`` carries (local files only):
    ``generation_config.json``, else the one transformers derives from ``config.json``. Its EOS
    id(s) end responses on every engine alike (:func:`rollout.stop_token_ids`)."""
    from transformers import AutoConfig, GenerationConfig

    if (Path(folder) / "generation_config.json").is_file():
        return GenerationConfig.from_pretrained(folder, local_files_only=True)
    return GenerationConfig.from_model_config(
        AutoConfig.from_pretrained(folder, local_files_only=True)
    )


def resolve_autocast(autocast: Optional[str], device: torch.device) -> Optional[torch.dtype]:
    """The autocast dtype for forwards, or None for none."""
    if autocast == "auto":
        return torch.bfloat16 if device.type == "cuda" else None
    if autocast is None or autocast == "none":
        return None
    # float16 would need loss scaling, which train_step does not do.
    if autocast != "bfloat16":
        raise ValueError(f"autocast must be auto, bfloat16 or None; got {autocast!r}")
    return torch.bfloat16


def resolve_device(device: str) -> torch.device:
    """``auto`` -> CUDA where available, else CPU; anything else as torch reads it."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str) -> torch.dtype:
    if dtype == "auto":
        # float32 master weights; speed on GPU comes from autocast (see HFBackendConfig).
        return torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {dtype!r}")
    return _DTYPES[dtype]


def byte_level_tokenizer():
    """A 259-id tokenizer built in memory: the 256 byte symbols plus <|pad|>, <|im_start|>,
    <|im_end|> (EOS), with a ChatML chat template. Any text round-trips exactly."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {sym: i for i, sym in enumerate(alphabet)}
    specials = ["<|pad|>", "<|im_start|>", "<|im_end|>"]
    for tok in specials:
        vocab[tok] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<|pad|>",
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
    )
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    tokenizer.chat_template = _CHATML
    return tokenizer


def _tiny_model_and_tokenizer(spec: TinyModelSpec, seed: int, dtype: torch.dtype):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if spec.tokenizer == "bytes":
        tokenizer = byte_level_tokenizer()
    elif spec.tokenizer == "smollm2":
        tokenizer = AutoTokenizer.from_pretrained(
            str(ensure_default_model()), local_files_only=True
        )
    else:
        raise ValueError(f"tiny.tokenizer must be 'bytes' or 'smollm2', got {spec.tokenizer!r}")
    config = LlamaConfig(
        # What transformers' own save_pretrained would add; the export writes config.json
        # itself, and the converter and the Megatron backend pick their mapping by it.
        architectures=["LlamaForCausalLM"],
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    # Seeded init inside fork_rng: the same seed gives the same weights without moving
    # the caller's global RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(dtype)
    return model, tokenizer


def ensure_tiny_folder(spec: TinyModelSpec, seed: int, cache: Optional[Path] = None) -> Path:
    """The "tiny-random" model as an HF folder under ``$NEMO_D3S_CACHE/tiny-random/<spec and
    seed>`` (same spec and seed, same weights), built once by the first rank that asks
    (:func:`~nemo_d3s.files.build_once`) while the others wait."""
    import dataclasses
    import hashlib
    import json

    from nemo_d3s.backends.hf.gguf_convert import cache_root
    from nemo_d3s.files import build_once

    key = json.dumps({"spec": dataclasses.asdict(spec), "seed": int(seed)}, sort_keys=True)
    out = (cache or cache_root()) / TINY_RANDOM / hashlib.sha256(key.encode()).hexdigest()[:16]

    def done(folder: Path) -> bool:
        return (folder / "nemo_d3s_tiny_random.json").is_file()

    def build(tmp: Path) -> None:
        model, tokenizer = _tiny_model_and_tokenizer(spec, seed, torch.float32)
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        (tmp / "nemo_d3s_tiny_random.json").write_text(key)  # written last: the folder is complete

    return build_once(out, build, done)


def zero_dropout_config(config) -> None:
    """Set every dropout probability of ``config`` to 0 (two forwards of one policy must agree)."""
    # RL ratios compare two forwards of the same weights; dropout would make them differ.
    for key, value in list(vars(config).items()):
        if isinstance(value, float) and ("dropout" in key or "pdrop" in key):
            setattr(config, key, 0.0)


def load_model_and_tokenizer(
    cfg: HFBackendConfig, device: Optional[torch.device] = None
) -> Tuple[torch.nn.Module, object]:
    """(model in eval mode on ``device``, tokenizer with a pad token), from local files only.

    Raises FileNotFoundError naming the path when ``cfg.model`` is neither a known name nor
    an existing directory.
    """
    # Every from_pretrained here passes local_files_only=True: the Hub is never contacted,
    # and the process environment (HF_HUB_OFFLINE) is left as the user set it.
    from transformers import AutoConfig, AutoModelForCausalLM

    device = device or resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype)
    if cfg.model == TINY_RANDOM:
        model, tokenizer = _tiny_model_and_tokenizer(cfg.tiny, cfg.seed, dtype)
    else:
        path = str(resolve_model_path(cfg.model))
        tokenizer = load_tokenizer(
            path
        )  # first: a folder without one fails before the weights load
        # A truncated or garbled weights file: one line naming it, not transformers' traceback.
        check_safetensors_folder(path)
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        zero_dropout_config(config)
        kwargs = {"attn_implementation": cfg.attn_implementation} if cfg.attn_implementation else {}
        model = AutoModelForCausalLM.from_pretrained(
            path, config=config, dtype=dtype, local_files_only=True, **kwargs
        )
    if tokenizer.pad_token_id is None:
        # Padding positions are always masked out, so reusing EOS as pad is harmless.
        tokenizer.pad_token = tokenizer.eos_token
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    model.to(device)
    model.eval()
    return model, tokenizer


@torch.no_grad()
def _copy_into_fused_experts(params: Dict[str, torch.Tensor], name: str, t: torch.Tensor) -> str:
    """Copy one expert's checkpoint tensor into transformers 5's fused expert parameter
    (``formats.moe.fused_target``); returns that parameter's name."""
    target, expert, half = fused_target(name)
    if target not in params:
        raise KeyError(f"no parameter {target!r} for {name!r}")
    p = params[target]
    if expert is not None:
        p = p[expert]
    if half is not None:
        p = p.narrow(0, half * t.shape[0], t.shape[0])
    p.copy_(t)
    return target


@torch.no_grad()
def copy_hf_weights(model: torch.nn.Module, weights, *, tie_word_embeddings: bool) -> None:
    """Copy (HF name, tensor) pairs into ``model`` one at a time (a tied ``lm_head`` from the
    embedding); KeyError naming an unknown name or the parameters left unfilled."""
    params = dict(model.named_parameters(remove_duplicate=False))
    seen = set()
    for name, t in weights:
        if name not in params and fused_target(name) is not None:
            seen.add(_copy_into_fused_experts(params, name, t))
            continue
        if name not in params:
            raise KeyError(f"{type(model).__name__} has no parameter {name!r}")
        params[name].copy_(t)
        seen.add(name)
    if tie_word_embeddings and "lm_head.weight" in params and "model.embed_tokens.weight" in seen:
        if params["lm_head.weight"].data_ptr() != params["model.embed_tokens.weight"].data_ptr():
            params["lm_head.weight"].copy_(params["model.embed_tokens.weight"])
        seen.add("lm_head.weight")
    missing = sorted(set(params) - seen)
    if missing:
        raise KeyError(f"no weights for {missing[:3]}")
