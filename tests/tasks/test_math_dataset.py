"""JSONL/JSON math datasets: answer parsing, errors naming file and row, held-out eval."""

import json
import random

import pytest

from nemo_d3s.tasks import make_task
from nemo_d3s.tasks.math_dataset import load_problems, parse_reference


def write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


GSM_ROWS = [
    {"question": f"Q{i}: what is {i} + {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i:,}"}
    for i in range(600, 640)
]


def test_parse_reference_formats():
    assert parse_reference("so 3 + 4\n#### 1,234") == "1234"
    assert parse_reference("hence $\\boxed{\\frac{1}{2}}$.") == "\\frac{1}{2}"
    assert parse_reference(" 17 ") == "17"
    assert parse_reference(12) == "12"
    assert parse_reference("no marker", "gsm8k") is None
    assert parse_reference(None) is None and parse_reference("  ") is None
    with pytest.raises(ValueError, match="answer_format"):
        parse_reference("1", "latex")


def test_gsm8k_loader_rewards(tmp_path):
    task = make_task("gsm8k", train_path=write_jsonl(tmp_path / "train.jsonl", GSM_ROWS), n_eval=10)
    p = task.sample_train(1, random.Random(0))[0]
    assert p.answer.isdigit() and "\\boxed{}" in p.prompt
    assert task.reward(p, f"Adding up... \\boxed{{{int(p.answer):,}}}") == 1.0
    assert task.reward(p, f"The answer is {p.answer}") == 1.0
    assert task.reward(p, f"\\boxed{{{int(p.answer) + 1}}}") == 0.0


def test_missing_answer_names_file_and_row(tmp_path):
    rows = GSM_ROWS[:3] + [{"question": "Q?", "answer": None}] + GSM_ROWS[3:5]
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(ValueError, match=r"bad\.jsonl: line 4 has no answer in field 'answer'"):
        load_problems(path)
    path2 = write_jsonl(tmp_path / "bad2.jsonl", [{"question": "Q?"}])
    with pytest.raises(ValueError, match=r"bad2\.jsonl: line 1 has no answer"):
        make_task("math_file", train_path=path2)
    path3 = write_jsonl(tmp_path / "bad3.jsonl", [{"question": "Q?", "answer": "7 with no marker"}])
    with pytest.raises(ValueError, match="line 1"):
        make_task("gsm8k", train_path=path3)


def test_jsonl_errors_name_the_physical_line_like_the_decoding_errors(tmp_path):
    """Issue 32: a row error counted non-blank rows ("row 3") while a bad byte or bad JSON
    named the physical line; with blank lines in the file the two disagreed."""
    path = tmp_path / "gaps.jsonl"
    path.write_text(
        '{"question": "a", "answer": "1"}\n\n\n{"question": "b"}\n'
        '{"question": "c", "answer": "2"}\n'
    )
    with pytest.raises(ValueError, match=r"gaps\.jsonl: line 4 has no answer"):
        load_problems(str(path))
    path.write_text('{"question": "a", "answer": "1"}\n\n\n{"question": \n')
    with pytest.raises(ValueError, match=r"gaps\.jsonl: line 4 is not valid JSON"):
        load_problems(str(path))


def test_bad_json_and_missing_file(tmp_path):
    bad = tmp_path / "x.jsonl"
    bad.write_text('{"question": "a", "answer": "1"}\n{not json}\n')
    with pytest.raises(ValueError, match="line 2"):
        load_problems(str(bad))
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_problems(str(tmp_path / "nope.jsonl"))


def test_custom_fields_math_style(tmp_path):
    rows = [
        {"problem": "Half of one?", "solution": "It is $\\boxed{\\frac{1}{2}}$."},
        {"problem": "x plus one?", "solution": "$\\boxed{x+1}$"},
    ]
    path = tmp_path / "math.json"
    path.write_text(json.dumps([{"problem": "Two halves?", "solution": "$\\boxed{1}$"}]))
    (tmp_path / "math_eval.json").write_text(json.dumps(rows))
    task = make_task(
        "math_file",
        train_path=str(path),
        eval_path=str(tmp_path / "math_eval.json"),
        question_field="problem",
        answer_field="solution",
    )
    half, poly = task.eval_set()
    assert half.answer == "\\frac{1}{2}" and poly.answer == "x+1"
    assert task.reward(half, "so \\boxed{0.5}") == 1.0 and task.reward(half, "Answer: 1/2") == 1.0
    assert task.reward(poly, "\\boxed{1 + x}") == 1.0 and task.reward(poly, "\\boxed{x+2}") == 0.0


def test_held_out_eval_is_fixed_and_disjoint(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", GSM_ROWS)
    a, b = (
        make_task("gsm8k", train_path=path, n_eval=8),
        make_task("gsm8k", train_path=path, n_eval=8),
    )
    assert [p.prompt for p in a.eval_set()] == [p.prompt for p in b.eval_set()]
    train = {p.prompt for p in a.sample_train(100, random.Random(0))}
    assert len(train) == len(GSM_ROWS) - 8 and not train & {p.prompt for p in a.eval_set()}
    with pytest.raises(ValueError, match="n_eval"):
        make_task("gsm8k", train_path=path, n_eval=len(GSM_ROWS))


def test_parquet_file_gives_the_same_problems_as_jsonl(tmp_path):
    # pyarrow is in the test extra, so this runs in CI.
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(GSM_ROWS), str(tmp_path / "train.parquet"))
    from_parquet = make_task("gsm8k", train_path=str(tmp_path / "train.parquet"), n_eval=10)
    from_jsonl = make_task(
        "gsm8k", train_path=write_jsonl(tmp_path / "train.jsonl", GSM_ROWS), n_eval=10
    )
    a, b = from_parquet.eval_set(), from_jsonl.eval_set()
    assert [p.prompt for p in a] == [p.prompt for p in b] and [p.answer for p in a] == [
        p.answer for p in b
    ]
    assert len(a) == 10


REPO_EXAMPLES = __import__("pathlib").Path(__file__).resolve().parents[2] / "examples"


def test_reward_fn_from_a_file_replaces_the_math_verifier(monkeypatch):
    """The README's example: examples/reward_last_number.py:score on examples/data/sums.jsonl."""
    monkeypatch.chdir(REPO_EXAMPLES.parent)
    task = make_task(
        "math_file",
        train_path="examples/data/sums.jsonl",
        answer_format="plain",
        n_eval=8,
        reward_fn="examples/reward_last_number.py:score",
    )
    p = task.eval_set()[0]
    assert task.reward(p, f"so it is {p.answer}") == 1.0
    assert (
        task.reward(p, f"{p.answer}, or maybe 1234567") == 0.2
    )  # the partial credit only this function gives
    assert task.reward(p, "no idea") == 0.0
    default = make_task(
        "math_file", train_path="examples/data/sums.jsonl", answer_format="plain", n_eval=8
    )
    assert default.reward(p, f"{p.answer}, or maybe 1234567") == 0.0


def test_reward_fn_from_a_module_and_its_errors(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def exact(response, answer):\n    return float(response.strip() == answer)\n"
    )
    data = tmp_path / "d.jsonl"
    data.write_text(
        "".join(json.dumps({"question": f"q{i}", "answer": str(i)}) + "\n" for i in range(5))
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    task = make_task(
        "math_file",
        train_path=str(data),
        answer_format="plain",
        n_eval=1,
        reward_fn="my_rewards:exact",
    )
    p = task.eval_set()[0]
    assert task.reward(p, p.answer) == 1.0 and task.reward(p, p.answer + "0") == 0.0
    for spec, message in [
        ("my_rewards.exact", "expected 'file.py:function'"),
        ("my_rewards:nope", "no function 'nope'"),
        ("no_such_module_xyz:f", "cannot import 'no_such_module_xyz'"),
    ]:
        with pytest.raises(ValueError, match=message):
            make_task("math_file", train_path=str(data), n_eval=1, reward_fn=spec)
    with pytest.raises(FileNotFoundError, match="task.params.reward_fn"):
        make_task(
            "math_file",
            train_path=str(data),
            n_eval=1,
            reward_fn=str(tmp_path / "missing.py") + ":f",
        )
