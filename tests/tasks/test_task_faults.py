"""Tasks as untrusted input (issue 9): dataset files that are folders, missing or not UTF-8
are named in one message; rewards outside a task's declared range are counted; reference
answers the verifier can never match are refused (all of them) or counted and named (issue 25)."""

from __future__ import annotations

from types import SimpleNamespace

import json
import logging
import math

import pytest
import torch

from nemo_d3s.tasks.base import Problem, checked_reward, out_of_range_rewards, safe_reward
from nemo_d3s.tasks.math_dataset import MathDatasetTask, read_rows
from nemo_d3s.tasks.tiny import TinyCharTask
from nemo_d3s.tasks.verifier import reference_is_checkable


def test_read_rows_names_a_folder_a_missing_file_and_non_utf8_lines(tmp_path):
    with pytest.raises(ValueError, match="is a directory"):
        read_rows(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_rows(str(tmp_path / "nope.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(
        b'{"question": "a", "answer": "1"}\n\n{"question": "\xff\xfe", "answer": "2"}\n'
    )
    with pytest.raises(ValueError, match=r"bad.jsonl: line 3 is not UTF-8"):
        read_rows(str(bad))
    bad_json = tmp_path / "bad.json"
    bad_json.write_bytes(b'[\n{"question": "a", "answer": "1"},\n{"question": "\xff"}]')
    with pytest.raises(ValueError, match=r"bad.json: line 3 is not UTF-8"):
        read_rows(str(bad_json))


def test_math_task_names_the_config_key_of_a_bad_path(tmp_path):
    with pytest.raises(ValueError, match="task.params.train_path is required"):
        MathDatasetTask("???")
    with pytest.raises(ValueError, match="task.params.train_path: dataset path .* is a directory"):
        MathDatasetTask(str(tmp_path))
    data = tmp_path / "t.jsonl"
    data.write_text(
        "".join(json.dumps({"question": f"{i}+1?", "answer": str(i + 1)}) + "\n" for i in range(6))
    )
    with pytest.raises(FileNotFoundError, match="task.params.eval_path"):
        MathDatasetTask(str(data), str(tmp_path / "missing.jsonl"))


def test_math_task_drops_problems_from_both_splits(tmp_path):
    data = tmp_path / "t.jsonl"
    data.write_text(
        "".join(json.dumps({"question": f"{i}+1?", "answer": str(i + 1)}) + "\n" for i in range(10))
    )
    task = MathDatasetTask(str(data), n_eval=3)
    dropped = task.drop_problems(lambda p: p.meta["row"] % 2 == 0)
    assert dropped["train"] + dropped["eval"] == 5
    rows = {p.meta["row"] for split in task.finite_problems().values() for p in split}
    assert rows == {1, 3, 5, 7, 9}


def test_an_eval_split_emptied_by_dropping_long_prompts_is_refused(tmp_path):
    """task.long_prompts=skip dropping every held-out row logged eval_reward_mean 0.0 over
    eval_n 0; it is one line instead."""
    data = tmp_path / "t.jsonl"
    data.write_text(
        "".join(json.dumps({"question": f"{i}+1?", "answer": str(i + 1)}) + "\n" for i in range(10))
    )
    task = MathDatasetTask(str(data), n_eval=3)
    held = {id(p) for p in task.eval_set()}
    with pytest.raises(ValueError, match=r"no evaluation rows left after dropping the 3 ") as e:
        task.drop_problems(lambda p: id(p) in held)
    assert "\n" not in str(e.value)


def test_a_question_repeated_in_the_training_file_is_not_both_held_out_and_trained(
    tmp_path, caplog
):
    """Without eval_path the eval rows are held out by index: a question on two rows could sit
    in both splits. 5 questions, each on two rows, 3 rows held out: an odd count, so some
    question's twin row was left in training."""
    data = tmp_path / "t.jsonl"
    data.write_text(
        "".join(
            json.dumps({"question": f"{i // 2}+1?", "answer": str(i // 2 + 1)}) + "\n"
            for i in range(10)
        )
    )
    with caplog.at_level(logging.WARNING, logger="nemo_d3s.tasks"):
        task = MathDatasetTask(str(data), n_eval=3)
    held = {p.prompt for p in task.eval_set()}
    train = task.finite_problems()["train"]
    assert len(task.eval_set()) == 3 and not held & {p.prompt for p in train}
    # every row whose question is not held out stays: 2 rows per such question
    assert len(train) == 2 * (5 - len(held))
    assert "in the rows held out for evaluation too" in caplog.text
    same = tmp_path / "same.jsonl"
    same.write_text(json.dumps({"question": "1+1?", "answer": "2"}) + "\n" * 1)
    same.write_text(same.read_text() * 4)
    with pytest.raises(ValueError, match=r"every training question is also among the 1 rows"):
        MathDatasetTask(str(same), n_eval=1)


def test_rewards_outside_the_declared_range_are_kept_counted_and_warned_once(caplog):
    class Loud(TinyCharTask):
        def reward(self, problem, response_text):
            return 1e30

    task, p = Loud(), Problem("q", "a")
    with caplog.at_level(logging.WARNING, logger="nemo_d3s.tasks"):
        for _ in range(3):
            assert safe_reward(task, p, "x") == (1e30, None)
    assert out_of_range_rewards(task) == 3
    assert caplog.text.count("outside the task's declared range [0.0, 1.0]") == 1
    plain = TinyCharTask()
    safe_reward(plain, p, "a")
    assert out_of_range_rewards(plain) == 0


@pytest.mark.parametrize(
    "value, kept",
    [
        (3.4028234663852886e38, True),  # float32's largest
        (-3.4028235e38, True),  # rounds to it
        (3.4028235677973366e38, False),  # 2^128 - 2^103: the tie, rounded to even = inf
        (3.5e38, False),  # finite in Python, inf as float32
        (-1e39, False),
        (1e300, False),
    ],
)
def test_a_reward_beyond_float32_is_a_non_finite_failure(value, kept):
    """The trainer holds rewards as float32: 3.5e38 would become inf there and stop the run
    in check_rewards; it fails like a NaN reward instead (0, counted as non_finite)."""

    class Huge(TinyCharTask):
        def reward(self, problem, response_text):
            return value

    got = checked_reward(Huge(), Problem("q", "a"), "x")
    if kept:
        assert got == (value, None, "")
        assert math.isfinite(torch.tensor(value, dtype=torch.float32).item())
    else:
        assert got[:2] == (0.0, "non_finite") and "float32" in got[2]
        assert math.isinf(torch.tensor(value, dtype=torch.float32).item())


def test_a_task_with_slots_is_counted_and_warned_once_too(caplog):
    # A task with __slots__ has no room for the count on itself: it is still counted (so
    # reward_out_of_range_total is right) and warned about once, not on every reward.
    class Slotted:
        __slots__ = ("name",)
        reward_range = (0.0, 1.0)

        def __init__(self) -> None:
            self.name = "slotted"

        def reward(self, problem, response_text):
            return 2.0

    task, other, p = Slotted(), Slotted(), Problem("q", "a")
    with caplog.at_level(logging.WARNING, logger="nemo_d3s.tasks"):
        for _ in range(3):
            assert safe_reward(task, p, "x") == (2.0, None)
        safe_reward(other, p, "x")
    assert out_of_range_rewards(task) == 3 and out_of_range_rewards(other) == 1
    assert caplog.text.count("outside the task's declared range") == 2  # once per task


@pytest.mark.parametrize(
    "gold, ok",
    [
        ("42", True),
        ("1,000", True),
        ("\\frac{\\pi}{2}", True),
        ("x", True),
        ("\\infty", True),
        ("(B)", True),
        ("2ab", True),
        ("seventy-two", False),
        ("yes", False),
        ("\\text{Monday}", False),
        ("", False),
    ],
)
def test_reference_is_checkable(gold, ok):
    assert reference_is_checkable(gold) is ok


def _words_file(tmp_path, answers):
    data = tmp_path / "words.jsonl"
    data.write_text(
        "".join(
            json.dumps({"question": f"q{i}?", "answer": a}) + "\n" for i, a in enumerate(answers)
        )
    )
    return data


def test_dataset_whose_references_none_can_be_checked_is_refused_naming_rows(tmp_path):
    """Used to train silently with reward 0 on every rollout."""
    data = _words_file(tmp_path, ["seventy-two", "yes", "no", "\\text{Monday}", "twelve"])
    with pytest.raises(ValueError) as e:
        MathDatasetTask(str(data), n_eval=1)
    msg = str(e.value)
    assert (
        msg.startswith("task.params.train_path: none of the 5 reference answers in")
        and str(data) in msg
    )
    assert "line 1: 'seventy-two', line 2: 'yes', line 3: 'no' ..." in msg and "answer_field" in msg
    verdict = MathDatasetTask.reward  # the reason: a correct-looking answer never scores
    no_reward_fn = SimpleNamespace(_reward_fn=None)  # the verifier's path, as for a loaded file
    assert verdict(no_reward_fn, Problem("q", "seventy-two"), "The answer is \\boxed{72}") == 0.0


def test_dataset_with_some_unparseable_references_counts_and_warns(tmp_path, caplog):
    data = _words_file(tmp_path, ["3", "seventy-two", "5", "yes", "7", "8"])
    with caplog.at_level(logging.WARNING, logger="nemo_d3s.tasks"):
        task = MathDatasetTask(str(data), n_eval=1)
    assert task.unusable_references == 2
    assert (
        "2 of 6 reference answers" in caplog.text
        and "line 2: 'seventy-two', line 4: 'yes'" in caplog.text
    )


def test_eval_path_equal_to_train_path_is_refused(tmp_path, monkeypatch):
    """Issue 32: it trained and evaluated on the same rows without a word (also through a
    relative path or a symlink to the same file)."""
    from nemo_d3s.tasks.base import make_task

    data = tmp_path / "d.jsonl"
    data.write_text("".join(f'{{"question": "q{i}", "answer": "{i}"}}\n' for i in range(6)))
    (tmp_path / "link.jsonl").symlink_to(data)
    monkeypatch.chdir(tmp_path)
    for other in (str(data), "d.jsonl", "link.jsonl"):
        with pytest.raises(ValueError, match=r"task.params.eval_path=.* is task.params.train_path"):
            make_task("math_file", train_path=str(data), eval_path=other)
    assert len(make_task("math_file", train_path=str(data), n_eval=2).eval_set()) == 2


def _rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_an_eval_file_with_the_training_questions_is_refused_or_left_out_of_training(
    tmp_path, caplog
):
    """A copy of the training file as eval_path (another name, the same questions) trained
    and evaluated on the same rows without a word; a partly overlapping one too."""
    rows = [{"question": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(6)]
    train = _rows(tmp_path / "train.jsonl", rows)
    copy = _rows(tmp_path / "copy.jsonl", list(reversed(rows)))
    with pytest.raises(ValueError, match=r"copy.jsonl' holds every question of .*train.jsonl"):
        MathDatasetTask(train, copy, answer_format="plain")
    some = _rows(tmp_path / "some.jsonl", rows[:2] + [{"question": "Other?", "answer": "7"}])
    with caplog.at_level(logging.WARNING, logger="nemo_d3s.tasks"):
        task = MathDatasetTask(train, some, answer_format="plain")
    split = task.finite_problems()
    assert len(split["train"]) == 4 and len(split["eval"]) == 3
    assert not {p.prompt for p in split["train"]} & {p.prompt for p in split["eval"]}
    assert "2 of 6 questions are in task.params.eval_path too (line 1, line 2)" in caplog.text


def test_a_question_with_two_reference_answers_is_warned(tmp_path, caplog):
    rows = [
        {"question": "What is 2 + 2?", "answer": "4"},
        {"question": "What is 3 + 3?", "answer": "6"},
        {"question": "What is 2 + 2?", "answer": "5"},
    ]
    with caplog.at_level(logging.WARNING, logger="nemo_d3s.tasks"):
        MathDatasetTask(_rows(tmp_path / "t.jsonl", rows), answer_format="plain", n_eval=1)
    assert "1 question(s) appear with different reference answers (line 1: '4' vs line 3: '5')" in (
        caplog.text
    )


@pytest.mark.parametrize("question", [12, ["a"], {"text": "a"}, True])
def test_a_question_that_is_not_text_is_refused_naming_the_row(tmp_path, question):
    """A number or a list as the question became its str() (a prompt of "12") without a word."""
    rows = [{"question": "What is 1 + 1?", "answer": "2"}, {"question": question, "answer": "3"}]
    path = _rows(tmp_path / "t.jsonl", rows)
    with pytest.raises(ValueError, match=r"t.jsonl: line 2: field 'question' holds a .*not the"):
        MathDatasetTask(path, answer_format="plain", n_eval=1)
