"""Several rollout engines per model-parallel group (``model.params.rollout_engines_per_copy``,
issue 41 item 8): the group's ranks cut into blocks, an engine on each block's first rank
generating a contiguous block of the prompts, each refitted from the whole group. The 70B/72B
recipes' 16-GPU copies span two nodes; one engine per copy (vLLM TP 8 = one node) left half
the GPUs idle in generation. The reference: the HF backend's engine over all the prompts in
one process, and the policy's own weights after a refit."""

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


def test_blocks_and_engine_ranks_hand_worked():
    """A group's ranks in any order cut into ascending blocks; the engines' global ranks of
    each recipe shape (70B: TP 4 x PP 4 x DP 4 in tp-pp-dp order, copies 16 consecutive
    ranks; 72B: TP 8 x PP 2 in the default order, stages 32 ranks apart; 32k: TP 8 x PP 2 x
    CP 2 x DP 2, tp-pp-dp, each CP rank's group on ranks 8c + 32k + {0..7, 16..23})."""
    from nemo_d3s.backends.megatron.parallel import (
        DEFAULT_ORDER,
        TP_PP_DP_ORDER,
        engine_blocks,
        engine_ranks_of_model_copies,
        first_ranks_of_model_copies,
    )

    assert engine_blocks([3, 0, 2, 1], 2) == [[0, 1], [2, 3]]
    assert engine_blocks([5, 9], 1) == [[5, 9]]
    with pytest.raises(ValueError, match="rollout_engines_per_copy=3: must divide the 4 ranks"):
        engine_blocks([0, 1, 2, 3], 3)
    assert engine_ranks_of_model_copies(4, 4, 4, TP_PP_DP_ORDER, 1, 2) == list(range(0, 64, 8))
    assert engine_ranks_of_model_copies(8, 2, 4, DEFAULT_ORDER, 1, 2) == [
        0, 32, 8, 40, 16, 48, 24, 56
    ]  # fmt: skip
    assert engine_ranks_of_model_copies(8, 2, 2, TP_PP_DP_ORDER, 2, 2) == [
        0, 16, 8, 24, 32, 48, 40, 56
    ]  # fmt: skip
    assert engine_ranks_of_model_copies(4, 4, 4, DEFAULT_ORDER, 1, 4) == [
        0, 16, 32, 48, 4, 20, 36, 52, 8, 24, 40, 56, 12, 28, 44, 60
    ]  # fmt: skip
    for shape in [(4, 4, 4, DEFAULT_ORDER, 1), (8, 2, 2, TP_PP_DP_ORDER, 2), (2, 1, 4)]:
        assert engine_ranks_of_model_copies(*shape) == first_ranks_of_model_copies(*shape)


def test_engine_positions_hand_worked():
    """(TP rank, stage) of the GPUs carrying an engine worker in a copy: TP 4 x PP 4 with a
    TP-8 engine per half (stages consecutive ranks): all 16; in the default order (stages
    TP x DP = 16 ranks apart) a TP-4 engine per half covers stages 0 and 2 only."""
    from nemo_d3s.backends.vllm.memory import engine_positions, engine_starts

    assert engine_starts(4, 4, 2) == [(0, 0), (0, 2)]
    assert engine_starts(8, 2, 2) == [(0, 0), (0, 1)]
    assert engine_starts(2, 3, 3) == [(0, 0), (0, 1), (0, 2)]
    every = {(t, p) for t in range(4) for p in range(4)}
    assert set(engine_positions(4, 4, 8, stage_stride_ranks=4, engines_per_copy=2)) == every
    assert engine_positions(4, 4, 8, stage_stride_ranks=4) == [
        (t, p) for p in (0, 1) for t in range(4)
    ]
    assert engine_positions(4, 4, 4, stage_stride_ranks=16, engines_per_copy=2) == [
        (t, p) for p in (0, 2) for t in range(4)
    ]
    # a TP-8 engine from stage 0 in the default order: only the stage's own 4 ranks are its
    assert engine_positions(4, 4, 8, stage_stride_ranks=16) == [(t, 0) for t in range(4)]


def test_the_option_is_checked_against_the_layout():
    from nemo_d3s.backends.megatron.config import MegatronBackendConfig, check_options

    check_options(MegatronBackendConfig(tensor_model_parallel_size=2, rollout_engines_per_copy=2))
    for bad in (3, 0, 1.5):
        with pytest.raises(ValueError, match=f"rollout_engines_per_copy={bad}"):
            check_options(
                MegatronBackendConfig(
                    tensor_model_parallel_size=2,
                    pipeline_model_parallel_size=2,
                    rollout_engines_per_copy=bad,
                )
            )


@pytest.mark.distributed
def test_two_engines_per_pp2_copy_each_generate_their_block_and_refit_from_the_copy(folders):
    """PP 2 with two engines (one per stage's rank): rank 0's engine sampled prompt 0 only,
    rank 1's prompts 1 and 2; both ranks hold every row, equal to the HF backend's engine over
    the three prompts in one process (per-prompt seeds). After the policy's weights change,
    one sync refits both engines from the whole copy: each holds the policy's full weights."""
    from nemo_d3s.backends.base import GenerationConfig
    from nemo_d3s.backends.hf.backend import HFBackend
    from nemo_d3s.backends.hf.config import HFBackendConfig

    folder = folders["llama"]
    gen = GenerationConfig(max_new_tokens=8)
    want = HFBackend(HFBackendConfig(model=folder, device="cpu")).rollout_engine.generate(
        PROMPTS, 2, gen, SEEDS
    )
    got = run_ranks(_rank_generate, 2, folder, pp=2, timeout=WAIT_S)
    assert [r["calls"] for r in got] == [[PROMPTS[:1]], [PROMPTS[1:]]]
    for r in got:
        assert r["srcs"] == [0, 1]
        assert torch.equal(r["input_ids"], want.batch.input_ids)
        assert torch.equal(r["prompt_index"], want.prompt_index)
        assert r["texts"] == want.response_texts
        assert r["stale_before"] and r["refit_max_err"] == 0.0


def _rank_generate(rank, folder):
    from nemo_d3s.backends.base import GenerationConfig
    from nemo_d3s.backends.megatron.backend import MegatronBackend
    from nemo_d3s.backends.megatron.config import MegatronBackendConfig

    pol = MegatronBackend(
        MegatronBackendConfig(
            model=folder, device="cpu", pipeline_model_parallel_size=2, rollout_engines_per_copy=2
        )
    )
    engine = pol.rollout_engine
    calls, inner_generate = [], engine.inner.generate

    def recorded(prompts, n, cfg, seeds):
        calls.append(list(prompts))
        return inner_generate(prompts, n, cfg, seeds)

    engine.inner.generate = recorded
    r = engine.generate(PROMPTS, 2, GenerationConfig(max_new_tokens=8), SEEDS)

    with torch.no_grad():  # new weights on both stages, then one sync for both engines
        for chunk in pol.model if isinstance(pol.model, list) else [pol.model]:
            for p in chunk.parameters():
                p.mul_(1.01)
    full = {n: t.clone() for n, t in pol.hf_weights()}  # collective
    held = dict(engine.held_weights())
    stale = any(not torch.equal(held[n], full[n]) for n in held)
    engine.sync_weights(pol)  # collective: two refits, one per engine
    held = dict(engine.held_weights())
    err = max(float((held[n] - full[n]).abs().max()) for n in held)
    return {
        "calls": calls,
        "srcs": engine.srcs,
        "input_ids": r.batch.input_ids,
        "prompt_index": r.prompt_index,
        "texts": r.response_texts,
        "stale_before": stale,
        "refit_max_err": err,
    }
