"""NeMo 2 with the real nemo-toolkit as the judge (collected only where a NeMo interpreter
exists, see conftest.py; tried with nemo-toolkit 2.7.3 + megatron-core 0.15.3 on CPU):

(a) NeMo's own HF importer (``llm.import_ckpt``) makes a NeMo 2 checkpoint of a tiny HF
    model; nemo_d3s reads it back bit for bit and ``verify`` agrees;
(b) the Megatron backend at TP2 starts from it (``model.name=<NeMo folder>`` directly, and
    through ``hf_to_megatron``) and scores as transformers does on the HF model (max abs
    err <= 1e-4);
(c) NeMo loads a NeMo 2 checkpoint that nemo_d3s wrote (``megatron_to_nemo``) and exports
    it to HF (``llm.export_ckpt``): the same tensors. NeMo's exporter cuts the vocabulary
    to its tokenizer's length (259 of 300 rows here), so those rows are compared.

The models are untied: NeMo 2.7's Qwen2 importer always writes
``share_embeddings_and_output_weights=False`` (a tied HF Qwen2 comes back untied, the
output layer a copy of the embedding); tied embeddings are covered by the layout tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _models import assert_same_tensors, hf_tensors, tiny  # noqa: E402
from _launch import run_ranks  # noqa: E402
from _nemo_env import nemo_python  # noqa: E402

from nemo_d3s.convert import hf_to_megatron, megatron_to_hf, megatron_to_nemo, verify  # noqa: E402
from _limits import WAIT_S  # noqa: E402

pytestmark = [pytest.mark.nemo, pytest.mark.slow]


def _nemo(*args):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [nemo_python(), os.path.join(HERE, "_nemo_side.py"), *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=WAIT_S,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def _tokenizer_for_transformers4(folder):
    """NeMo 2.x runs transformers 4.57: a tokenizer_config.json it reads (the files that
    transformers 5 writes name the TokenizersBackend class)."""
    p = folder / "tokenizer_config.json"
    cfg = json.loads(p.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["additional_special_tokens"] = cfg.pop("extra_special_tokens", [])
    cfg.pop("backend", None)
    p.write_text(json.dumps(cfg))


def _rank_scores(rank, folder, ids):
    from nemo_d3s.backends.base import TokenBatch
    from nemo_d3s.backends.megatron.backend import MegatronBackend
    from nemo_d3s.backends.megatron.config import MegatronBackendConfig

    pol = MegatronBackend(
        MegatronBackendConfig(model=folder, device="cpu", tensor_model_parallel_size=2)
    )
    attn = torch.ones_like(ids, dtype=torch.bool)
    return pol.score(TokenBatch(ids, attn, attn), with_entropy=False).logprobs


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_nemo_toolkit_imports_loads_and_exports(arch, tmp_path):
    from transformers import AutoModelForCausalLM

    from nemo_d3s.core.entropy import align_to_tokens, entropy_and_logprobs

    src = tiny(tmp_path / "hf", arch, tied=False)  # NeMo's Qwen2 importer unties embeddings anyway
    _tokenizer_for_transformers4(src)
    # (a) NeMo's importer -> nemo_d3s reads it
    nemo = tmp_path / "nemo"
    assert "import done" in _nemo("import", src, nemo)
    back = megatron_to_hf(nemo, tmp_path / "back", progress=False)
    assert_same_tensors(src, back)
    res = verify(src, nemo)
    assert res.ok and res.max_abs_err == 0.0, res.verdict()
    # (b) the Megatron backend (TP2 on 2 ranks) starts from it, directly (model.name=<NeMo
    # folder>) and after hf_to_megatron, and matches transformers
    start = hf_to_megatron(nemo, tmp_path / "start", progress=False)
    ids = torch.tensor([[5, 70, 71, 72, 101, 33, 9, 250, 7, 64]])
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    with torch.no_grad():
        want = align_to_tokens(
            entropy_and_logprobs(model(input_ids=ids).logits[:, :-1], ids[:, 1:])[1]
        )
    for folder in (nemo, start):
        lp = run_ranks(_rank_scores, 2, str(folder), ids, tp=2, pp=1, timeout=WAIT_S)[0]
        assert float((lp - want).abs().max()) <= 1e-4, folder
    # (c) nemo_d3s writes a NeMo 2 checkpoint (from a TP2 x PP2 Megatron one); NeMo loads it
    ck = hf_to_megatron(src, tmp_path / "ck", tp=2, pp=2, progress=False)
    ours = megatron_to_nemo(ck, tmp_path / "ours", nemo_context=nemo, progress=False)
    exported = tmp_path / "exported"
    assert "export done" in _nemo("export", ours, exported)
    got, source = hf_tensors(exported), hf_tensors(src)
    assert sorted(got) == sorted(source)
    for k, t in got.items():
        assert torch.equal(t, source[k][: t.shape[0]]), k
    assert got["model.embed_tokens.weight"].shape[0] >= 259  # the tokenizer's rows, at least
