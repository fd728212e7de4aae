"""The tiny random model as a folder (what the Megatron backend loads for
``model.name=tiny-random``), and the seeded sampler's use of transformers' KV-cache name."""

from __future__ import annotations

import logging

import torch

from nemo_d3s.backends.hf.config import HFBackendConfig, TinyModelSpec
from nemo_d3s.backends.hf.loading import (
    _tiny_model_and_tokenizer,
    ensure_tiny_folder,
    load_model_and_tokenizer,
)


def test_tiny_folder_holds_the_in_memory_tiny_model_and_is_written_once(tmp_path):
    spec = TinyModelSpec()
    folder = ensure_tiny_folder(spec, seed=3, cache=tmp_path)
    assert (folder / "config.json").is_file() and (folder / "tokenizer.json").is_file()
    mtime = (folder / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_folder(spec, seed=3, cache=tmp_path) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == mtime  # reused, not rewritten
    assert ensure_tiny_folder(spec, seed=4, cache=tmp_path) != folder  # another seed, another model
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".")]  # no temp folder left
    ref, _ = _tiny_model_and_tokenizer(spec, 3, torch.float32)
    loaded, _ = load_model_and_tokenizer(HFBackendConfig(model=str(folder), device="cpu"))
    for (name, a), (_, b) in zip(ref.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name


def test_seeded_sampler_uses_transformers_cache_name_without_its_deprecation_warning():
    """transformers 5 warns once per process when ``past_key_values`` is used; the sampler
    uses the name the installed transformers takes, so the warning never fires."""
    from transformers.utils import logging as hf_logging

    from nemo_d3s.backends.base import GenerationConfig
    from nemo_d3s.backends.hf.sampling import decode_seeded

    model, tok = _tiny_model_and_tokenizer(TinyModelSpec(), 0, torch.float32)
    seen = []

    class Catch(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    root = hf_logging.get_logger("transformers")
    handler = Catch()
    root.addHandler(handler)
    hf_logging.get_logger("transformers.utils.generic").warning_once.cache_clear()
    try:
        rows, _ = decode_seeded(
            model,
            [[1, 2, 3], [4, 5]],
            [0, 1],
            GenerationConfig(max_new_tokens=4),
            pad_id=tok.pad_token_id,
            eos_ids=[tok.eos_token_id],
            device=torch.device("cpu"),
        )
    finally:
        root.removeHandler(handler)
    assert len(rows) == 2
    assert not [m for m in seen if "past_key_values" in m], seen
