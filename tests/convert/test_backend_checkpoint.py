"""Conversion against the Megatron backend itself, on gloo ranks:

- a TP1 checkpoint made by ``hf_to_megatron`` is what a 4-rank TP2 x PP2
  ``MegatronBackend(model=CKPT)`` starts from (its exported weights are the HF source's,
  bit for bit); it trains one step and saves a training checkpoint (megatron/ only, no
  config.json), which ``megatron_to_hf`` converts on ONE process; transformers' log-probs
  and entropy on that folder match the backend's scores at TP2 x PP2 (max abs err <= 1e-4,
  fp32), its tensors are the backend's exported weights bit for bit, and ``verify`` agrees;
  the checkpoint carries the model's config.json and tokenizer, so no --hf-config is needed,
  and a checkpoint without them (as older versions wrote) converts with --hf-config;
- a one-process backend starts from a TP2 x PP2 conversion of a tied Qwen2 model;
- a backend refuses a converted checkpoint with a flipped bit or a truncated shard, naming
  the file, before it builds the model (two ranks share the checksum reading and both
  refuse; ``model.params.verify_checksums=false`` skips the checksums).
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest

from nemo_d3s.files import write_checksums
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _models import assert_same_tensors, hf_tensors, tiny  # noqa: E402
from _launch import run_ranks  # noqa: E402  (tests/distributed, put on the path by _models)

from nemo_d3s.convert import hf_to_megatron, megatron_to_hf, verify  # noqa: E402
from nemo_d3s.errors import ConfigError  # noqa: E402
from _limits import WAIT_S  # noqa: E402

pytestmark = pytest.mark.distributed

B, S = 4, 10
LENGTHS = [10, 6, 8, 4]
PROMPT = [3, 2, 4, 2]


def _batch():
    from nemo_d3s.backends.base import TokenBatch

    g = torch.Generator().manual_seed(3)
    pos = torch.arange(S)
    attn = pos < torch.tensor(LENGTHS).unsqueeze(1)
    resp = attn & (pos >= torch.tensor(PROMPT).unsqueeze(1))
    ids = torch.randint(0, 256, (B, S), generator=g) * attn
    return TokenBatch(ids, attn, resp)


def _backend(model, tp, pp, **kw):
    from nemo_d3s.backends.megatron.backend import MegatronBackend
    from nemo_d3s.backends.megatron.config import MegatronBackendConfig

    return MegatronBackend(
        MegatronBackendConfig(
            model=str(model),
            device="cpu",
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            lr=1e-2,
            adam_eps=1e-3,
            **kw,
        )
    )


def _transformers_scores(folder, batch):
    from transformers import AutoModelForCausalLM

    from nemo_d3s.core.entropy import align_to_tokens, entropy_and_logprobs

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask.long()).logits
        ent, lp = entropy_and_logprobs(logits[:, :-1], batch.input_ids[:, 1:])
    attn = batch.attention_mask.float()
    return align_to_tokens(lp) * attn, align_to_tokens(ent) * attn


def _rank_train_and_save(rank, converted, ckpt):
    from nemo_d3s.core.losses import LossConfig, loss_denominator
    from nemo_d3s.trainer.update import UpdateBatch, make_loss_fn

    pol = _backend(converted, 2, 2)
    start = dict(pol.hf_weights())
    batch = _batch()
    lp = pol.score(batch, with_entropy=False, micro_batch_size=2).logprobs
    keep = batch.response_mask.clone()
    adv = torch.tensor([1.0, -0.5, 0.3, -1.0])
    upd = UpdateBatch(
        batch=batch,
        old_logprobs=lp + 0.1,
        advantages=adv,
        token_keep=keep,
        minibatch=torch.zeros(B, dtype=torch.long),
    )
    loss_fn = make_loss_fn("grpo", LossConfig(aggregation="token_mean", check_inputs=False), upd)
    pol.train_step(batch, loss_fn, 2, denominator=float(loss_denominator(keep, "token_mean")))
    pol.save_checkpoint(ckpt)
    sc = pol.score(batch, with_entropy=True, micro_batch_size=2)
    return start, dict(pol.hf_weights()), sc.logprobs, sc.entropy


def test_tp2_pp2_training_checkpoint_converts_on_one_process(tmp_path):
    src = tiny(tmp_path / "src", "llama")
    converted = hf_to_megatron(src, tmp_path / "converted", tp=1, pp=1, progress=False)
    ckpt = tmp_path / "run" / "checkpoints" / "step_000001"
    results = run_ranks(
        _rank_train_and_save, 4, str(converted), str(ckpt), tp=2, pp=2, timeout=WAIT_S
    )
    source = hf_tensors(src)
    start, trained, logprobs, entropy = results[0]
    assert sorted(start) == sorted(source)
    for k in source:
        assert torch.equal(start[k], source[k]), k  # the backend started from the conversion
    assert any(not torch.equal(trained[k], source[k]) for k in source)  # and trained
    for res in results[1:]:
        assert torch.equal(res[2], logprobs) and torch.equal(res[3], entropy)
    # the checkpoint describes itself: config.json (with the parameters' dtype) and tokenizer
    names = set(os.listdir(ckpt))
    assert {"megatron", "config.json", "tokenizer.json", "tokenizer_config.json"} <= names, names
    assert json.loads((ckpt / "config.json").read_text())["num_hidden_layers"] == 4

    write_checksums(ckpt)  # what the trainer adds to the backend's files (issue 32: required)
    out = megatron_to_hf(ckpt, tmp_path / "hf", progress=False)  # no --hf-config
    # a checkpoint written before they were kept (megatron/ only) converts with --hf-config
    old = tmp_path / "old" / "step_000001"
    shutil.copytree(ckpt / "megatron", old / "megatron")
    write_checksums(old)
    with pytest.raises(ConfigError, match="has no config.json .* pass --hf-config"):
        megatron_to_hf(old, tmp_path / "hf_old", progress=False)
    assert_same_tensors(
        megatron_to_hf(old, tmp_path / "hf_old", hf_config=src, progress=False), out
    )
    exported = hf_tensors(out)
    assert sorted(exported) == sorted(trained)
    for k in trained:
        assert torch.equal(exported[k], trained[k]), k
    lp, ent = _transformers_scores(out, _batch())
    assert float((lp - logprobs).abs().max()) <= 1e-4
    assert float((ent - entropy).abs().max()) <= 1e-4
    res = verify(out, ckpt, hf_config=src)
    assert res.ok and res.max_abs_err == 0.0 and res.layout == "TP2 x PP2"
    assert not verify(src, ckpt, hf_config=src).ok  # the trained weights differ from the start


def _rank_start_from(rank, converted):
    pol = _backend(converted, 1, 1)
    sc = pol.score(_batch(), with_entropy=True, micro_batch_size=2)
    return dict(pol.hf_weights()), sc.logprobs, sc.entropy


def test_backend_starts_from_a_tp2_pp2_conversion_on_one_rank(tmp_path):
    src = tiny(tmp_path / "src", "qwen2")  # tied embeddings, q/k/v bias
    converted = hf_to_megatron(src, tmp_path / "converted", tp=2, pp=2, progress=False)
    weights, logprobs, entropy = run_ranks(
        _rank_start_from, 1, str(converted), tp=1, pp=1, timeout=WAIT_S
    )[0]
    source = hf_tensors(src)
    assert sorted(weights) == sorted(source)
    for k in source:
        assert torch.equal(weights[k], source[k]), k
    lp, ent = _transformers_scores(src, _batch())
    assert float((lp - logprobs).abs().max()) <= 1e-4
    assert float((ent - entropy).abs().max()) <= 1e-4


def _rank_start_error(rank, model, verify_checksums):
    try:
        _backend(model, 1, 1, verify_checksums=verify_checksums)
    except ConfigError as e:
        return str(e)
    return None


def test_backend_refuses_a_flipped_bit_or_a_truncated_shard(tmp_path):
    """Issue 25 items 4 and 5 at the backend's start."""
    src = tiny(tmp_path / "src", "llama")
    converted = hf_to_megatron(src, tmp_path / "converted", tp=1, pp=1, progress=False)
    shard = converted / "megatron" / "tp00_pp00.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10  # inside a tensor: the header still parses
    shard.write_bytes(bytes(data))
    # two ranks share the reading (checksum_shares puts the one shard in one rank's share,
    # the small files in the other's) and the all-gathered finding makes both refuse alike;
    # a corrupt file in each rank's share in turn: tests/trainer/test_checkpoint_shared.py
    errors = run_ranks(_rank_start_error, 2, str(converted), True, timeout=WAIT_S)
    assert errors[0] == errors[1] and errors[0] is not None and str(converted) in errors[0]
    assert "megatron/tp00_pp00.safetensors does not match its SHA-256 checksum" in errors[0]
    assert "model.params.verify_checksums=false" in errors[0]
    assert (
        run_ranks(_rank_start_error, 1, str(converted), False, timeout=WAIT_S)[0] is None
    )  # the switch skips it
    shard.write_bytes(bytes(data[:-100]))  # an interrupted copy
    err = run_ranks(_rank_start_error, 1, str(converted), False, timeout=WAIT_S)[0]
    assert err is not None and f"{str(shard)!r} is truncated" in err


def test_backend_refuses_a_converted_checkpoint_without_checksums_json(tmp_path):
    """Issue 32: the Megatron backend trained on it without a notice; the one policy
    (formats.checksums.missing_checksums) refuses it on every rank, naming the switch."""
    src = tiny(tmp_path / "src", "llama")
    converted = hf_to_megatron(src, tmp_path / "converted", tp=1, pp=1, progress=False)
    (converted / "checksums.json").unlink()
    errors = run_ranks(_rank_start_error, 2, str(converted), True, timeout=WAIT_S)
    assert errors[0] == errors[1] and errors[0] is not None and str(converted) in errors[0]
    assert "has no checksums.json" in errors[0] and "verify_checksums=false" in errors[0]
    assert run_ranks(_rank_start_error, 1, str(converted), False, timeout=WAIT_S)[0] is None
