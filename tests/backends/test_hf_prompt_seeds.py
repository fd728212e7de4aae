"""Batched generation with per-prompt seeds: a prompt's samples must not depend on which
other prompts (of other lengths, hence other left padding) share the call."""

import pytest
import torch

from nemo_d3s.backends.base import GenerationConfig
from nemo_d3s.backends.hf import HFBackend, HFBackendConfig
from nemo_d3s.backends.hf.sampling import row_seed, sample_next

PROMPTS = [
    "hi",
    "what is 2+2? answer with a long explanation please",
    "x",
    "a medium length prompt",
]
SEEDS = [11, 22, 33, 44]
CFGS = [
    GenerationConfig(max_new_tokens=16),
    GenerationConfig(max_new_tokens=16, temperature=0.7, top_p=0.9, top_k=40),
    GenerationConfig(max_new_tokens=8, do_sample=False),
]


@pytest.fixture(scope="module")
def backend():
    return HFBackend(
        HFBackendConfig(model="tiny-random", device="cpu", dtype="float32", autocast=None)
    )


def rows_of(r, i, n):
    """Prompt i's rows as (token id lists, texts, finished), without the padding."""
    ids, attn = r.batch.input_ids[i * n : (i + 1) * n], r.batch.attention_mask[i * n : (i + 1) * n]
    return (
        [row[m].tolist() for row, m in zip(ids, attn)],
        r.response_texts[i * n : (i + 1) * n],
        r.finished[i * n : (i + 1) * n].tolist(),
    )


@pytest.mark.parametrize("cfg", CFGS)
def test_prompt_samples_do_not_depend_on_batch_composition(backend, cfg):
    n = 3
    full = backend.generate(PROMPTS, n, cfg, SEEDS)
    shuffled = backend.generate(PROMPTS[::-1], n, cfg, SEEDS[::-1])
    for i, (p, s) in enumerate(zip(PROMPTS, SEEDS)):
        alone = backend.generate([p], n, cfg, [s])
        assert rows_of(full, i, n) == rows_of(alone, 0, n)
        assert rows_of(shuffled, len(PROMPTS) - 1 - i, n) == rows_of(alone, 0, n)


def test_int_seed_means_consecutive_prompt_seeds(backend):
    cfg = CFGS[0]
    a = backend.generate(PROMPTS[:2], 2, cfg, 5)
    b = backend.generate(PROMPTS[:2], 2, cfg, [5, 6])
    assert torch.equal(a.batch.input_ids, b.batch.input_ids)


def test_same_seed_same_output_and_seeds_matter(backend):
    cfg = CFGS[0]
    a = backend.generate(PROMPTS, 4, cfg, SEEDS)
    b = backend.generate(PROMPTS, 4, cfg, SEEDS)
    c = backend.generate(PROMPTS, 4, cfg, [s + 100 for s in SEEDS])
    assert (
        torch.equal(a.batch.input_ids, b.batch.input_ids) and a.response_texts == b.response_texts
    )
    assert not torch.equal(a.batch.input_ids, c.batch.input_ids)
    # Samples of one prompt differ from each other (distinct per-sample generators).
    assert len({tuple(r) for r in rows_of(a, 1, 4)[0]}) > 1


def test_generation_batch_size_does_not_change_samples():
    cfg = CFGS[1]
    whole = HFBackend(HFBackendConfig(model="tiny-random", device="cpu", autocast=None))
    chunked = HFBackend(
        HFBackendConfig(model="tiny-random", device="cpu", autocast=None, generation_batch_size=5)
    )
    a, b = whole.generate(PROMPTS, 3, cfg, SEEDS), chunked.generate(PROMPTS, 3, cfg, SEEDS)
    for i in range(len(PROMPTS)):
        assert rows_of(a, i, 3) == rows_of(b, i, 3)


def test_sampler_matches_hand_worked_inverse_cdf():
    # probs [0.1, 0.2, 0.3, 0.4]: cdf [0.1, 0.3, 0.6, 1.0];
    # u=0.05 -> 0, 0.3 -> 2 (right side), 0.99 -> 3.
    logits = torch.tensor([[0.1, 0.2, 0.3, 0.4]]).log().repeat(3, 1)
    u = torch.tensor([0.05, 0.3, 0.99])
    assert sample_next(logits, u, GenerationConfig()).tolist() == [0, 2, 3]
    # top_k=2 keeps {3, 2} renormalised to [4/7, 3/7] in sorted order: u=0.5 -> id 3, u=0.6 -> id 2.
    got = sample_next(logits[:2], torch.tensor([0.5, 0.6]), GenerationConfig(top_k=2))
    assert got.tolist() == [3, 2]
    # top_p=0.5: sorted probs [0.4, 0.3, ...], mass before token 2 is 0.4 < 0.5 -> keep {3, 2}.
    got = sample_next(logits[:2], torch.tensor([0.5, 0.6]), GenerationConfig(top_p=0.5))
    assert got.tolist() == [3, 2]


def test_bad_seed_length_raises(backend):
    with pytest.raises(ValueError, match="seed"):
        backend.generate(PROMPTS, 2, CFGS[0], [1, 2])


def test_sampler_on_a_uniform_grid_reproduces_the_distribution():
    # Midpoints of N equal bins of [0, 1) land in token j exactly p_j * N times when
    # every p_j * N is an integer: inverse-CDF sampling with nothing lost or shifted.
    probs = torch.tensor([0.125, 0.5, 0.0, 0.25, 0.125])
    n = 64
    logits = probs.log().expand(n, -1)
    u = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    counts = torch.bincount(sample_next(logits, u, GenerationConfig()), minlength=5)
    assert counts.tolist() == (probs * n).long().tolist()
    # Temperature 2 flattens: p ~ sqrt(p) -> weights [1, 2, 0, sqrt 2, 1] / (4 + sqrt 2).
    hot = (
        torch.bincount(
            sample_next(logits, u, GenerationConfig(temperature=2.0)), minlength=5
        ).double()
        / n
    )
    w = probs.double().sqrt() / probs.double().sqrt().sum()
    assert torch.allclose(hot, w, atol=1.0 / n)


def test_row_seeds_do_not_collide_for_nearby_prompts_and_samples():
    seeds = {row_seed(s, j) for s in range(64) for j in range(64)}
    assert len(seeds) == 64 * 64 and all(0 <= x < 2**63 for x in seeds)


def test_hf_generate_sampler_is_seeded_per_call_and_layout_dependent():
    b = HFBackend(
        HFBackendConfig(model="tiny-random", device="cpu", autocast=None, sampler="hf_generate")
    )
    assert not b.rollout_engine.prompt_seeds
    cfg = CFGS[0]
    x, y = b.generate(PROMPTS, 2, cfg, seed=3), b.generate(PROMPTS, 2, cfg, seed=3)
    assert torch.equal(x.batch.input_ids, y.batch.input_ids) and len(x.batch) == 8
    assert x.batch.response_mask.any(1).all()
    with pytest.raises(ValueError, match="one int seed per call"):
        b.generate(PROMPTS, 2, cfg, seed=SEEDS)


def test_unknown_sampler_is_rejected():
    with pytest.raises(ValueError, match="sampler"):
        HFBackend(HFBackendConfig(model="tiny-random", device="cpu", sampler="beam"))
