"""HFBackend on the random tiny Llama (byte-level tokenizer, CPU, seconds)."""

import io
import os

import pytest
import torch

from nemo_d3s.backends.base import GenerationConfig, TokenBatch
from nemo_d3s.backends.hf import HFBackend, HFBackendConfig, TinyModelSpec, resolve_model_path
from nemo_d3s.backends.hf.rollout import encode_prompts

PROMPTS = ["What is 2+2?", "Say hi", "A much longer prompt than the others, to force left padding."]


def _logprobs(policy, batch, **kw):
    """(logprobs, entropy) of ``policy.score``."""
    out = policy.score(batch, **kw)
    return out.logprobs, out.entropy


def make_backend(**overrides) -> HFBackend:
    cfg = dict(model="tiny-random", device="cpu", seed=0, lr=1e-3)
    cfg.update(overrides)
    return HFBackend(HFBackendConfig(**cfg))


@pytest.fixture(scope="module")
def backend():
    return make_backend(use_reference=True)


@pytest.fixture(scope="module")
def eos_backend():
    """Tiny model whose output layer is biased towards EOS, so responses end early."""
    b = make_backend(tiny=TinyModelSpec(tie_word_embeddings=False))
    head = b.model.lm_head
    biased = torch.nn.Linear(head.in_features, head.out_features, bias=True)
    with torch.no_grad():
        biased.weight.copy_(head.weight)
        biased.bias.zero_()
        biased.bias[b.tokenizer.eos_token_id] = 3.0  # p(EOS) about 7% per token
    b.model.lm_head = biased
    return b


def check_rollout_layout(b: HFBackend, r, prompts, n, max_new):
    B = len(prompts) * n
    ids, attn, resp = r.batch.input_ids, r.batch.attention_mask, r.batch.response_mask
    assert ids.shape == attn.shape == resp.shape and ids.shape[0] == B
    assert attn.dtype == torch.bool and resp.dtype == torch.bool
    assert r.prompt_index.tolist() == [i for i in range(len(prompts)) for _ in range(n)]
    assert len(r.response_texts) == B and r.finished.shape == (B,)
    encoded = encode_prompts(b.tokenizer, prompts)
    eos = set(b.eos_ids)
    for row in range(B):
        length = int(attn[row].sum())
        # Right padding: real tokens form a prefix, padding holds pad_id.
        assert attn[row, :length].all() and not attn[row, length:].any()
        assert (ids[row, length:] == b.pad_id).all()
        prompt = encoded[int(r.prompt_index[row])]
        assert ids[row, : len(prompt)].tolist() == prompt
        # The response is exactly the tokens after the prompt, up to the end of the row.
        assert not resp[row, : len(prompt)].any() and resp[row, len(prompt) : length].all()
        assert not resp[row, length:].any()
        response = ids[row, len(prompt) : length].tolist()
        assert 1 <= len(response) <= max_new
        assert not (set(response[:-1]) & eos), "an EOS inside a response: it must end there"
        if r.finished[row]:
            assert response[-1] in eos
        else:
            assert len(response) == max_new and response[-1] not in eos
        assert r.response_texts[row] == b.tokenizer.decode(response, skip_special_tokens=True)


def test_generate_layout_and_masks(backend):
    r = backend.generate(PROMPTS, 4, GenerationConfig(max_new_tokens=12), seed=1)
    check_rollout_layout(backend, r, PROMPTS, 4, 12)
    assert r.stats["gen_tokens"] == float(r.batch.response_mask.sum())


def test_response_mask_stops_at_first_eos(eos_backend):
    r = eos_backend.generate(PROMPTS, 6, GenerationConfig(max_new_tokens=24), seed=0)
    check_rollout_layout(eos_backend, r, PROMPTS, 6, 24)
    # Both kinds of row occur, so both branches of the layout check ran.
    assert r.finished.any() and not r.finished.all()


def test_generate_is_seeded_and_leaves_global_rng_alone(backend):
    cfg = GenerationConfig(max_new_tokens=8)
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    a = backend.generate(PROMPTS[:2], 2, cfg, seed=7)
    assert torch.equal(torch.rand(3), expected_next)
    b = backend.generate(PROMPTS[:2], 2, cfg, seed=7)
    c = backend.generate(PROMPTS[:2], 2, cfg, seed=8)
    assert torch.equal(a.batch.input_ids, b.batch.input_ids)
    assert not torch.equal(a.batch.input_ids, c.batch.input_ids)


def test_generation_batch_size_chunks_give_valid_rollouts():
    b = make_backend(generation_batch_size=2)
    r = b.generate(PROMPTS, 3, GenerationConfig(max_new_tokens=6), seed=0)
    check_rollout_layout(b, r, PROMPTS, 3, 6)


def test_greedy_generation_is_identical_across_samples(backend):
    r = backend.generate(
        PROMPTS[:1], 3, GenerationConfig(max_new_tokens=6, do_sample=False), seed=0
    )
    assert len(set(r.response_texts)) == 1


def naive_logprobs_entropy(model, batch: TokenBatch, temperature: float = 1.0):
    """Obvious reference: one full forward, log_softmax (of logits / T), gather, shift by one."""
    with torch.no_grad():
        logits = model(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask.long()
        ).logits.double()
    logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)
    lp = logp[:, :-1].gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)[:, :-1]
    zero = torch.zeros(len(batch), 1, dtype=torch.float64)
    mask = batch.attention_mask.double()
    return torch.cat([zero, lp], 1) * mask, torch.cat([zero, ent], 1) * mask


def test_score_matches_naive_forward(backend):
    r = backend.generate(PROMPTS, 2, GenerationConfig(max_new_tokens=10), seed=3)
    lp, ent = _logprobs(backend, r.batch, with_entropy=True, micro_batch_size=4)
    ref_lp, ref_ent = naive_logprobs_entropy(backend.model, r.batch)
    assert lp.shape == ent.shape == r.batch.input_ids.shape and lp.dtype == torch.float32
    resp = r.batch.response_mask
    assert resp.sum() > 10
    assert torch.allclose(lp.double()[resp], ref_lp[resp], atol=1e-4)
    assert torch.allclose(ent.double()[resp], ref_ent[resp], atol=1e-4)
    assert (lp[:, 0] == 0).all() and (ent[:, 0] == 0).all()
    assert (lp[~r.batch.attention_mask] == 0).all() and (ent[~r.batch.attention_mask] == 0).all()
    # Prompt positions before the micro-batch's first response token are not scored.
    first = int(resp.any(0).int().argmax())
    assert first > 1 and (lp[:, :first] == 0).all() and (ent[:, :first] == 0).all()
    lp1, none = _logprobs(backend, r.batch, with_entropy=False, micro_batch_size=1)
    assert none is None and torch.allclose(lp1[resp], lp[resp], atol=1e-5)


@pytest.mark.parametrize("packed", [False, True])
def test_rollouts_sampled_at_a_temperature_are_scored_at_it(packed):
    """The sampler draws from softmax(logits / T); scoring and the update took log-probs of
    softmax(logits) whatever T was, so every importance ratio and the entropy of token
    selection were of a distribution the rollouts did not come from."""
    T = 0.5
    b = make_backend(logit_temperature=T, pack_sequences=packed, autocast=None)
    b.rollout_engine.return_logprobs = True  # the sampler's own (behaviour) log-probs
    r = b.generate(PROMPTS, 2, GenerationConfig(max_new_tokens=10, temperature=T), seed=3)
    resp = r.batch.response_mask
    lp, ent = _logprobs(b, r.batch, with_entropy=True, micro_batch_size=4)
    ref_lp, ref_ent = naive_logprobs_entropy(b.model, r.batch, temperature=T)
    assert torch.allclose(lp.double()[resp], ref_lp[resp], atol=1e-4)
    assert torch.allclose(ent.double()[resp], ref_ent[resp], atol=1e-4)
    assert torch.allclose(lp[resp], r.sampling_logprobs[resp], atol=1e-4)
    untempered, _ = naive_logprobs_entropy(b.model, r.batch)
    assert (untempered[resp] - ref_lp[resp]).abs().max() > 0.05  # T = 0.5 is not T = 1 here
    # the update's log-probs are the same tempered ones: ratio 1 at the weights sampled
    seen = torch.zeros_like(lp)

    def loss(logprobs, rows):
        seen[rows, : logprobs.shape[1]] = logprobs.detach()
        return logprobs.sum() * 0.0

    b.train_step(r.batch, loss, micro_batch_size=4, denominator=1.0)
    assert torch.allclose(seen[resp], lp[resp], atol=1e-5)


def test_reference_model_is_a_frozen_copy():
    b = make_backend(use_reference=True, lr=1e-2)
    r = b.generate(PROMPTS[:2], 2, GenerationConfig(max_new_tokens=6), seed=0)
    before, _ = _logprobs(b, r.batch, with_entropy=False)
    ref, ref_ent = _logprobs(b, r.batch, with_entropy=True, reference=True)
    assert ref_ent is None and torch.equal(ref, before)
    b.train_step(r.batch, lambda lp, rows: -lp.sum(), micro_batch_size=4, denominator=100.0)
    after, _ = _logprobs(b, r.batch, with_entropy=False)
    ref_after, _ = _logprobs(b, r.batch, with_entropy=False, reference=True)
    assert not torch.allclose(after, before) and torch.equal(ref_after, ref)
    with pytest.raises(ValueError, match="use_reference"):
        _logprobs(make_backend(), r.batch, with_entropy=False, reference=True)


def fixed_batch(b: HFBackend, n=4, seed=0) -> TokenBatch:
    return b.generate(PROMPTS[:2], n // 2, GenerationConfig(max_new_tokens=10), seed=seed).batch


def grpo_like_loss(batch: TokenBatch, advantages: torch.Tensor):
    """Sum of -A * logprob over response tokens (the loss contract: a SUM; the backend
    divides by the step's global denominator, here ``D(batch)``)."""

    def loss_fn(lp, rows):
        mask = batch.response_mask[rows].to(lp.device)
        return -(advantages[rows, None] * lp * mask).sum()

    return loss_fn


def D(batch: TokenBatch) -> float:
    """The global token count of a one-process step (the trainer's token_mean denominator)."""
    return float(batch.response_mask.sum())


def grads(b: HFBackend):
    return [p.grad.clone() for p in b.params]


def test_microbatch_size_does_not_change_gradients_or_update():
    b1, b4 = make_backend(), make_backend()
    batch = fixed_batch(b1)
    loss_fn = grpo_like_loss(batch, torch.tensor([1.0, -0.5, 2.0, -1.5]))
    b1.accumulate_gradients(batch, loss_fn, micro_batch_size=1, denominator=D(batch))
    b4.accumulate_gradients(batch, loss_fn, micro_batch_size=4, denominator=D(batch))
    for g1, g4 in zip(grads(b1), grads(b4)):
        assert torch.allclose(g1, g4, atol=1e-6, rtol=1e-4)
    b1.optimizer.zero_grad(), b4.optimizer.zero_grad()
    m1 = b1.train_step(batch, loss_fn, micro_batch_size=1, denominator=D(batch))
    m4 = b4.train_step(batch, loss_fn, micro_batch_size=3, denominator=D(batch))
    assert m1["grad_norm"] == pytest.approx(m4["grad_norm"], rel=1e-5) and m1["grad_norm"] > 0
    assert m1["n_micro_batches"] == 4 and m4["n_micro_batches"] == 2
    # Adam's first step moves each weight by about lr * g / (|g| + eps): for gradients near
    # eps, float-noise differences between micro-batchings reach a few 1e-3 of lr.
    for p1, p4 in zip(b1.params, b4.params):
        assert torch.allclose(p1, p4, atol=1e-5)


def test_token_budget_gives_the_same_gradients_and_scores_with_less_padding():
    """``micro_batch_tokens``: rows sorted by length and packed to a token budget give the
    gradient (and log-probs) of fixed micro-batches, feeding fewer padded positions."""
    from nemo_d3s.core.micro_batches import row_lengths

    fixed, budget = make_backend(), make_backend()
    r = fixed.generate(PROMPTS, 2, GenerationConfig(max_new_tokens=10), seed=1)
    batch = r.batch.select(torch.tensor([0, 4, 1, 5, 2, 3]))  # fixed pairs mix short and long rows
    lengths = row_lengths(batch.attention_mask)
    tokens = 2 * int(lengths.max())
    assert int(lengths.max()) > 2 * int(lengths.min())
    loss_fn = grpo_like_loss(batch, torch.tensor([1.0, -0.5, 2.0, -1.5, 0.3, -0.7]))
    a = fixed.accumulate_gradients(batch, loss_fn, 2, denominator=D(batch))
    b = budget.accumulate_gradients(
        batch, loss_fn, 2, denominator=D(batch), micro_batch_tokens=tokens
    )
    for g1, g2 in zip(grads(fixed), grads(budget)):
        assert torch.allclose(g1, g2, atol=1e-6, rtol=1e-4)
    assert float(b["fed_tokens"]) < float(a["fed_tokens"])
    assert (
        float(a["attended_tokens"])
        == float(b["attended_tokens"])
        == float(batch.attention_mask.sum())
    )
    s1 = fixed.score(batch, with_entropy=True, micro_batch_size=2)
    s2 = budget.score(batch, with_entropy=True, micro_batch_size=2, micro_batch_tokens=tokens)
    resp = batch.response_mask
    assert torch.allclose(s1.logprobs[resp], s2.logprobs[resp], atol=1e-5)
    assert torch.allclose(s1.entropy[resp], s2.entropy[resp], atol=1e-5)
    assert s2.stats["fed_tokens"] < s1.stats["fed_tokens"]
    assert s1.stats["attended_tokens"] == float(batch.attention_mask.sum())


def test_gradient_checkpointing_gives_the_same_gradients():
    plain, ckpt = make_backend(), make_backend(gradient_checkpointing=True)
    flag = (
        "is_activation_checkpointing"
        if hasattr(ckpt.model, "is_activation_checkpointing")
        else "is_gradient_checkpointing"
    )
    assert getattr(ckpt.model, flag) and not getattr(plain.model, flag)
    batch = fixed_batch(plain)
    loss_fn = grpo_like_loss(batch, torch.tensor([1.0, -1.0, 0.5, 0.0]))
    plain.accumulate_gradients(batch, loss_fn, 2, denominator=D(batch))
    ckpt.accumulate_gradients(batch, loss_fn, 2, denominator=D(batch))
    for a, c in zip(grads(plain), grads(ckpt)):
        assert torch.allclose(a, c, atol=1e-6, rtol=1e-4)


def test_train_step_raises_logprob_of_rewarded_response():
    b = make_backend(lr=1e-2)
    batch = fixed_batch(b)
    loss_fn = grpo_like_loss(batch, torch.ones(4))
    before, _ = _logprobs(b, batch, with_entropy=False)
    for _ in range(3):
        m = b.train_step(batch, loss_fn, micro_batch_size=2, denominator=D(batch))
    after, _ = _logprobs(b, batch, with_entropy=False)
    mask = batch.response_mask
    assert after[mask].sum() > before[mask].sum()
    assert set(m) >= {"grad_norm", "lr", "loss_sum"} and m["lr"] == pytest.approx(1e-2)


def test_train_step_with_zero_rows_still_steps_cleanly():
    b = make_backend()
    empty = fixed_batch(b).select(torch.arange(0))
    assert len(empty) == 0
    m = b.train_step(empty, lambda lp, rows: lp.sum(), micro_batch_size=2, denominator=1.0)
    assert m["grad_norm"] == 0.0 and m["n_micro_batches"] == 0 and m["skipped"] == 0.0


def test_non_finite_gradient_skips_the_update():
    b = make_backend()
    batch = fixed_batch(b)
    before = [p.clone() for p in b.params]
    m = b.train_step(
        batch, lambda lp, rows: lp.sum() * float("nan"), micro_batch_size=4, denominator=1.0
    )
    assert m["skipped"] == 1.0
    assert all(torch.equal(p, q) for p, q in zip(before, b.params))


def test_warmup_and_cosine_schedule():
    b = make_backend(lr=1.0, warmup_steps=2, scheduler="cosine", total_steps=6, min_lr_ratio=0.1)
    batch = fixed_batch(b).select(torch.arange(1))
    lrs = [
        b.train_step(batch, lambda lp, rows: 0 * lp.sum(), 1, denominator=1.0)["lr"]
        for _ in range(7)
    ]
    assert lrs[:3] == pytest.approx([0.5, 1.0, 1.0])
    assert lrs[-1] == pytest.approx(0.1) and all(x >= y for x, y in zip(lrs[2:], lrs[3:]))
    with pytest.raises(ValueError, match="total_steps"):
        make_backend(scheduler="linear")


def test_state_dict_round_trip_continues_identically():
    a, c = make_backend(), make_backend(seed=1)
    batch = fixed_batch(a)
    loss_fn = grpo_like_loss(batch, torch.tensor([1.0, -1.0, 0.5, 0.0]))
    a.train_step(batch, loss_fn, 2, denominator=D(batch))
    # Through bytes, as a checkpoint file would be (in memory, torch's optimizer
    # load_state_dict would share a's moment tensors with c).
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    c.load_state_dict(torch.load(buf, weights_only=True))
    ma, mc = (x.train_step(batch, loss_fn, 2, denominator=D(batch)) for x in (a, c))
    assert ma["grad_norm"] == pytest.approx(mc["grad_norm"])
    assert all(torch.equal(p, q) for p, q in zip(a.params, c.params))


def test_save_pretrained_round_trip(tmp_path, backend):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "policy"
    backend.save_pretrained(str(out))
    backend.save_pretrained(str(out))  # overwriting an existing export is fine
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["policy"], "temporary folders left behind"
    model = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True)
    tok = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    assert (
        tok("héllo <|im_end|>")["input_ids"] == backend.tokenizer("héllo <|im_end|>")["input_ids"]
    )
    batch = fixed_batch(backend)
    ref_lp, _ = naive_logprobs_entropy(model, batch)
    lp, _ = _logprobs(backend, batch, with_entropy=False)
    resp = batch.response_mask
    assert torch.allclose(lp.double()[resp], ref_lp[resp], atol=1e-4)
    reloaded = make_backend(model=str(out))
    lp2, _ = _logprobs(reloaded, batch, with_entropy=False)
    assert torch.allclose(lp2, lp, atol=1e-5)


def test_missing_model_directory_is_a_clear_error(tmp_path):
    missing = tmp_path / "no_such_model"
    with pytest.raises(FileNotFoundError, match="no_such_model"):
        resolve_model_path(str(missing))
    with pytest.raises(FileNotFoundError, match="no_such_model"):
        make_backend(model=str(missing))


def test_loading_leaves_the_environment_alone(monkeypatch, tmp_path):
    """Offline by argument (local_files_only=True), not by rewriting the process environment."""
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    before = dict(os.environ)
    b = make_backend()
    b.save_pretrained(str(tmp_path / "m"))
    make_backend(model=str(tmp_path / "m"))  # a local folder goes through from_pretrained
    assert dict(os.environ) == before


def test_bad_arguments_raise_value_error(backend):
    batch = fixed_batch(backend)
    with pytest.raises(ValueError, match="n_samples"):
        backend.generate(PROMPTS, 0, GenerationConfig(), seed=0)
    with pytest.raises(ValueError, match="micro_batch_size"):
        _logprobs(backend, batch, with_entropy=False, micro_batch_size=0)
    with pytest.raises(ValueError, match="dtype"):
        make_backend(dtype="float8")


def test_stop_tokens_join_eos_when_in_vocab(backend):
    tok = backend.tokenizer
    assert backend.eos_ids == sorted([tok.eos_token_id, tok.convert_tokens_to_ids("<|im_start|>")])
    assert make_backend(stop_tokens=()).eos_ids == [tok.eos_token_id]
