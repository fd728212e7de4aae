"""Task registry, reasoning-gym presets, the tiny task, and safe_reward."""

import math
import re
import random

import pytest

from nemo_d3s.tasks import TASKS, Problem, Task, make_task, safe_reward

RG_PRESETS = ["chain_sum", "basic_arithmetic", "gsm_symbolic", "countdown"]


def test_registry_lists_tasks_and_rejects_unknown():
    assert {"tiny", "math_file", "gsm8k", "reasoning_gym", *RG_PRESETS} <= set(TASKS.names())
    with pytest.raises(ValueError, match="chain_sum"):
        make_task("chain_summ")


@pytest.fixture(scope="module", params=RG_PRESETS)
def rg_task(request):
    return make_task(request.param, n_eval=24)


def test_reasoning_gym_right_and_wrong_answers(rg_task):
    for p in rg_task.sample_train(4, random.Random(0)):
        assert "Answer:" in p.prompt
        assert rg_task.reward(p, f"Let me think.\nAnswer: {p.answer}") == 1.0
        assert rg_task.reward(p, f"\\boxed{{{p.answer}}}") == 1.0
        assert rg_task.reward(p, "Answer: 123456789") == 0.0  # no partial credit by default
        assert rg_task.reward(p, "") == 0.0


def test_reasoning_gym_eval_set_fixed_distinct_and_held_out(rg_task):
    ev = rg_task.eval_set()
    assert len(ev) == 24 and len({p.prompt for p in ev}) == 24
    again = make_task(rg_task.name, n_eval=24).eval_set()
    assert [p.prompt for p in again] == [p.prompt for p in ev] and [p.answer for p in again] == [
        p.answer for p in ev
    ]
    eval_prompts = {p.prompt for p in ev}
    train = rg_task.sample_train(200, random.Random(1))
    assert not eval_prompts & {p.prompt for p in train}
    assert all(p.meta["split"] == "train" for p in train)


def test_reasoning_gym_train_sampling_is_seeded():
    task = make_task("chain_sum", n_eval=8)
    a = [p.prompt for p in task.sample_train(5, random.Random(3))]
    assert a == [p.prompt for p in task.sample_train(5, random.Random(3))]
    assert a == [p.prompt for p in task.sample_train(5, 3)]
    assert a != [p.prompt for p in task.sample_train(5, random.Random(4))]
    assert task.sample_train(0, random.Random(0)) == []


def test_chain_sum_hand_case():
    task = make_task("chain_sum", n_eval=4)
    p = Problem(
        "What is 3 + 4?", "7", {"entry": {"question": "3 + 4 =", "answer": "7", "metadata": {}}}
    )
    assert task.reward(p, "3 + 4 = 7\nAnswer: 7") == 1.0
    assert task.reward(p, "Answer: 7.0") == 1.0
    assert task.reward(p, "Answer: 8") == 0.0
    assert task.reward(p, "I think it is 7 or so") == 1.0  # untagged: last number


def test_preset_config_override_and_generic_adapter():
    task = make_task("chain_sum", config={"min_terms": 4, "max_terms": 4}, n_eval=3)
    assert all(p.meta["entry"]["metadata"]["num_terms"] == 4 for p in task.eval_set())
    generic = make_task("reasoning_gym", dataset="chain_sum", n_eval=3, partial_credit=True)
    p = generic.eval_set()[0]
    assert generic.name == "chain_sum" and generic.reward(p, f"Answer: {p.answer}") == 1.0


def test_tiny_task_rewards_and_splits():
    task = make_task("tiny", targets="ab")
    p = task.sample_train(1, random.Random(0))[0]
    assert (
        task.reward(p, "abxy") == 0.5 and task.reward(p, "") == 0.0 and task.reward(p, "zzz") == 0.0
    )
    contains = make_task("tiny", targets="ab", mode="contains")
    assert contains.reward(p, "zzb") == 1.0 and contains.reward(p, "zz") == 0.0
    ev = task.eval_set()
    assert len(ev) == 16 and [q.prompt for q in ev] == [
        q.prompt for q in make_task("tiny", targets="ab").eval_set()
    ]
    train = {q.meta["id"] for q in task.sample_train(500, random.Random(1))}
    assert not train & {q.meta["id"] for q in ev}
    with pytest.raises(ValueError, match="mode"):
        make_task("tiny", mode="count")


def test_tiny_task_has_reward_variance_on_random_text():
    task = make_task("tiny")
    p = task.eval_set()[0]
    rng = random.Random(0)
    rewards = [
        task.reward(p, bytes(rng.randrange(256) for _ in range(32)).decode("latin-1"))
        for _ in range(16)
    ]
    assert len(set(rewards)) >= 3  # GRPO groups get non-zero advantages


class _Broken(Task):
    name = "broken"

    def __init__(self, value):
        self.value = value

    def sample_train(self, n, rng):
        return []

    def eval_set(self):
        return []

    def reward(self, problem, text):
        if isinstance(self.value, Exception):
            raise self.value
        return self.value


def test_safe_reward_catches_errors_and_nan():
    p = Problem("q", "a")
    assert safe_reward(_Broken(0.5), p, "x") == (0.5, None)
    r, err = safe_reward(_Broken(ZeroDivisionError("boom")), p, "x")
    assert r == 0.0 and "ZeroDivisionError" in err and "boom" in err
    r, err = safe_reward(_Broken(math.nan), p, "x")
    assert r == 0.0 and "non-finite" in err
    r, err = safe_reward(_Broken(math.inf), p, "x")
    assert r == 0.0 and err


def test_too_large_eval_set_names_the_task_once_and_the_fix():
    from nemo_d3s.config import ConfigError
    from nemo_d3s.trainer.tasks_adapter import build_task

    # two single-digit terms with + and -: 10 x 10 x 2 sums, a few phrasings each: a few hundred at
    # most
    with pytest.raises(ConfigError) as err:
        build_task("basic_arithmetic", {"n_eval": 1000})
    msg = str(err.value)
    found = int(re.search(r"exceeds the (\d+) distinct questions", msg).group(1))
    assert msg.count("basic_arithmetic") == 1 and 0 < found < 1000 and "task.eval_size" in msg
