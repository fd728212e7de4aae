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
from _limits import WAIT_S  # noqa: E402


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


def test_a_rank_that_finds_the_tiny_folder_being_built_waits_for_it(tmp_path):
    """Issue 32: every rank of the README's Megatron command asks for the tiny folder on an
    empty cache; the one that found another rank's folder lock died with FolderBusy. It now
    waits for the lock and uses (or, the builder gone, builds) the folder."""
    import hashlib
    import json
    import threading
    import time
    import dataclasses

    from nemo_d3s.files import FileLock

    spec = TinyModelSpec()
    key = json.dumps({"spec": dataclasses.asdict(spec), "seed": 5}, sort_keys=True)
    out = tmp_path / "tiny-random" / hashlib.sha256(key.encode()).hexdigest()[:16]
    out.parent.mkdir(parents=True)
    held = FileLock(out.parent / f".{out.name}.lock", remove=True).acquire()  # "rank 0" builds
    result = {}

    def other_rank():
        try:
            result["folder"] = ensure_tiny_folder(spec, seed=5, cache=tmp_path)
        except BaseException as e:  # noqa: BLE001 - the test reports what the rank died of
            result["error"] = e

    t = threading.Thread(target=other_rank)
    t.start()
    time.sleep(1.0)
    assert "error" not in result, result  # it used to die here: FolderBusy
    assert t.is_alive() and not out.exists()  # waiting, not building beside the holder
    held.release()
    t.join(timeout=WAIT_S)
    assert result.get("folder") == out and (out / "nemo_d3s_tiny_random.json").is_file(), result
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # no lock file left
