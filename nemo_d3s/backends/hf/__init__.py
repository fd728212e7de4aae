"""Hugging Face transformers backend: one process per model replica (CPU or one GPU),
optionally data parallel over a torch process group.

Import ``HFBackend`` from here; building it imports transformers lazily enough that the
rest of nemo_d3s does not pay for it.
"""

from nemo_d3s.backends.hf.config import HFBackendConfig, TinyModelSpec
from nemo_d3s.backends.hf.gguf_convert import (
    DEFAULT_MODEL_NAME,
    cache_root,
    ensure_default_model,
    find_embedded_gguf,
)
from nemo_d3s.backends.hf.loading import TINY_RANDOM, load_model_and_tokenizer, resolve_model_path

__all__ = [
    "DEFAULT_MODEL_NAME",
    "HFBackend",
    "HFBackendConfig",
    "TINY_RANDOM",
    "TinyModelSpec",
    "cache_root",
    "ensure_default_model",
    "find_embedded_gguf",
    "load_model_and_tokenizer",
    "resolve_model_path",
]


def __getattr__(name):
    # HFBackend pulls in nemo_d3s.core.entropy and the model stack; import it on first use.
    if name == "HFBackend":
        from nemo_d3s.backends.hf.backend import HFBackend

        return HFBackend
    raise AttributeError(name)
