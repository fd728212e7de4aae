"""Rollouts under context parallelism (backends/megatron/cp_rollouts.py): each CP rank's
TP x PP group generates a block of the copy's prompts and the CP group gathers them. The
reference: the HF backend's engine over all the prompts in one process."""

from __future__ import annotations

import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "distributed"))
from _launch import run_ranks  # noqa: E402
from _limits import WAIT_S  # noqa: E402

PROMPTS = ["hi there", "abc", "a longer prompt than the others"]
SEEDS = [5, 6, 7]


def _rows(n_prompts, n, width, fill):
    from nemo_d3s.backends.base import Rollouts, TokenBatch

    ids = torch.full((n_prompts * n, width), fill, dtype=torch.long)
    mask = torch.ones_like(ids, dtype=torch.bool)
    return Rollouts(
        batch=TokenBatch(input_ids=ids, attention_mask=mask, response_mask=mask.clone()),
        prompt_index=torch.arange(n_prompts).repeat_interleave(n),
        response_texts=[f"{fill}"] * (n_prompts * n),
        finished=torch.ones(n_prompts * n, dtype=torch.bool),
        stats={"gen_tokens": float(n_prompts * n * width)},
    )


def test_blocks_are_contiguous_and_rejoin_in_prompt_order():
    """3 prompts over CP 2: [0, 1) and [1, 3); 1 prompt over CP 2: rank 0 has none. Joined:
    rows re-padded to the longest (pad 0), prompt_index into the whole list, counts summed."""
    from nemo_d3s.backends.megatron.cp_rollouts import join_blocks, prompt_blocks

    assert prompt_blocks(3, 2) == [range(0, 1), range(1, 3)]
    assert prompt_blocks(1, 2) == [range(0, 0), range(0, 1)]
    assert prompt_blocks(5, 3) == [range(0, 1), range(1, 3), range(3, 5)]
    blocks = prompt_blocks(3, 2)
    joined = join_blocks([_rows(1, 2, 4, 7), _rows(2, 2, 2, 9)], blocks, pad_id=0)
    assert joined.prompt_index.tolist() == [0, 0, 1, 1, 2, 2]
    assert joined.batch.input_ids.tolist() == [[7] * 4] * 2 + [[9, 9, 0, 0]] * 4
    assert joined.batch.attention_mask.sum(1).tolist() == [4, 4, 2, 2, 2, 2]
    assert joined.response_texts == ["7", "7", "9", "9", "9", "9"]
    assert joined.stats["gen_tokens"] == 8 + 8
    one = join_blocks([None, _rows(1, 2, 3, 4)], prompt_blocks(1, 2), pad_id=0)
    assert one.prompt_index.tolist() == [0, 0] and one.batch.input_ids.shape == (2, 3)
    with pytest.raises(RuntimeError, match="returned no rollouts"):
        join_blocks([None, None], blocks, pad_id=0)


@pytest.mark.distributed
def test_cp2_ranks_each_generate_their_block_and_get_what_one_engine_samples(folders):
    """Two ranks at CP 2 (the policy's own seeded engine, one per CP rank's group): rank 0's
    engine sampled prompt 0 only, rank 1's prompts 1 and 2, and both ranks hold every row,
    equal to the HF backend's engine over the three prompts in one process."""
    from nemo_d3s.backends.base import GenerationConfig
    from nemo_d3s.backends.hf.backend import HFBackend
    from nemo_d3s.backends.hf.config import HFBackendConfig

    folder = folders["llama"]
    gen = GenerationConfig(max_new_tokens=8)
    want = HFBackend(HFBackendConfig(model=folder, device="cpu")).rollout_engine.generate(
        PROMPTS, 2, gen, SEEDS
    )
    got = run_ranks(_rank_generate, 2, folder, cp=2, timeout=WAIT_S)
    assert [calls for calls, _ in got] == [[PROMPTS[:1]], [PROMPTS[1:]]]
    for _, r in got:
        assert torch.equal(r["input_ids"], want.batch.input_ids)
        assert torch.equal(r["prompt_index"], want.prompt_index)
        assert r["texts"] == want.response_texts


def _rank_generate(rank, folder):
    from nemo_d3s.backends.base import GenerationConfig
    from nemo_d3s.backends.megatron.backend import MegatronBackend
    from nemo_d3s.backends.megatron.config import MegatronBackendConfig
    from nemo_d3s.backends.megatron.cp_rollouts import ContextParallelRollouts

    pol = MegatronBackend(
        MegatronBackendConfig(model=folder, device="cpu", context_parallel_size=2)
    )
    engine = pol.rollout_engine
    assert isinstance(engine, ContextParallelRollouts)
    calls, inner_generate = [], engine.inner.generate

    def recorded(prompts, n, cfg, seeds):
        calls.append(list(prompts))
        return inner_generate(prompts, n, cfg, seeds)

    engine.inner.generate = recorded
    r = engine.generate(PROMPTS, 2, GenerationConfig(max_new_tokens=8), SEEDS)
    return calls, {
        "input_ids": r.batch.input_ids,
        "prompt_index": r.prompt_index,
        "texts": r.response_texts,
    }


@pytest.mark.distributed
@pytest.mark.parametrize("fault", ["interrupted", "failed"])
def test_a_cp_rank_cut_short_or_failing_stops_every_cp_rank(fault):
    """Rank 1's engine is cut short by a stop signal (or raises): rank 0, whose block
    finished, does not wait in the gather but raises too (GenerationInterrupted; RuntimeError
    naming the other rank's failure), and rank 1 raises its own."""
    out = run_ranks(_rank_fault, 2, fault, megatron=False, timeout=WAIT_S)
    if fault == "interrupted":
        assert out == ["GenerationInterrupted", "GenerationInterrupted"]
    else:
        assert out[0].startswith("RuntimeError: the generation failed on 1 other rank")
        assert out[1] == "ValueError: engine broke"


class _Engine:
    tokenizer = None
    prompt_seeds = on_policy = own_weights = refit_on_generate = True
    stopped = False
    should_stop = None

    def __init__(self, fault):
        self.fault = fault

    def generate(self, prompts, n, cfg, seeds):
        import torch.distributed as dist

        from nemo_d3s.backends.base import GenerationInterrupted

        if dist.get_rank() == 1:
            if self.fault == "interrupted":
                raise GenerationInterrupted("stop requested during generation")
            raise ValueError("engine broke")
        return _rows(len(prompts), n, 3, 1)

    def alive(self):
        return True


def _rank_fault(rank, fault):
    import torch.distributed as dist

    from nemo_d3s.backends.base import GenerationConfig
    from nemo_d3s.backends.megatron.cp_rollouts import ContextParallelRollouts

    engine = ContextParallelRollouts(_Engine(fault), dist.group.WORLD, pad_id=0)
    try:
        engine.generate(["a", "b"], 2, GenerationConfig(max_new_tokens=4), [1, 2])
        out = "returned"
    except Exception as e:
        out = type(e).__name__ if fault == "interrupted" else f"{type(e).__name__}: {e}"
    dist.barrier()  # rank 0 hosts the store: it stays until the other rank's last read
    return out
