"""Test tasks whose rewards misbehave, registered when this module is imported: by the tests,
and by each reward worker process (which imports the module registering its task), so it
imports nothing heavier than the tiny task."""

from __future__ import annotations

from nemo_d3s.tasks.base import TASKS
from nemo_d3s.tasks.tiny import TinyCharTask


class HugeReward(TinyCharTask):
    def reward(self, problem, response_text):
        return 1e30 if len(response_text) % 2 else 0.0


class BrokenVerifier(TinyCharTask):
    def reward(self, problem, response_text):
        raise RuntimeError("verifier service unreachable")


class ZeroReward(TinyCharTask):
    """A verifier that never matches (as with references it cannot read): reward 0 always."""

    def reward(self, problem, response_text):
        return 0.0


class ConstantTask(TinyCharTask):
    """Every response gets the same reward: every group is degenerate."""

    def reward(self, problem, response_text):
        return 1.0


class VariedTask(TinyCharTask):
    """A reward that differs between almost any two responses: no group is degenerate."""

    def reward(self, problem, response_text):
        return (31 * len(response_text) + sum(map(ord, response_text))) % 97 / 97


class FlakyTask(TinyCharTask):
    """The reward raises for some responses and is NaN for others (by first character)."""

    def reward(self, problem, response_text):
        code = ord(response_text[0]) if response_text else 0
        if code % 3 == 0:
            raise RuntimeError("verifier exploded")
        if code % 3 == 1:
            return float("nan")
        return super().reward(problem, response_text)


for _name, _cls in (
    ("fault_huge_reward", HugeReward),
    ("fault_broken_verifier", BrokenVerifier),
    ("fault_zero_reward", ZeroReward),
    ("test_constant", ConstantTask),
    ("test_flaky", FlakyTask),
    ("test_varied", VariedTask),
):
    if _name not in TASKS:
        TASKS.register(_name)(_cls)
