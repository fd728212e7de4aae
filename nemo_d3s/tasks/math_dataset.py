"""GSM8K / MATH-style datasets from local JSONL, JSON or Parquet files.

Each row has a question and a reference answer, parsed by ``answer_format``: ``"gsm8k"``
(after the last "####"), ``"boxed"`` (the last ``\\boxed{...}``), ``"plain"``, or ``"auto"`` (gsm8k,
else boxed, else plain). Rewards check the response's answer with ``verify_math``; a file with no
reference the verifier can match is refused, otherwise such rows are counted
(``unusable_references``, in ``summary.json``) and named in a warning. ``reward_fn="file.py:score"``
or ``"package.module:score"`` replaces the verifier: ``score(response: str, answer: str) -> float``,
references then unchecked."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from nemo_d3s.tasks.answers import extract_answer, extract_boxed
from nemo_d3s.core.checks import check_count
from nemo_d3s.tasks.base import TASKS, Problem, Task, as_rng
from nemo_d3s.tasks.dataset_checks import drop_overlap, warn_conflicting_answers
from nemo_d3s.tasks.verifier import reference_is_checkable, verify_math

log = logging.getLogger("nemo_d3s.tasks")

BOXED_SUFFIX = "\n\nPlease reason step by step, and put your final answer within \\boxed{}."
ANSWER_FORMATS = ("auto", "gsm8k", "boxed", "plain")


def read_rows(path: str) -> List[Dict[str, Any]]:
    """Rows of a .jsonl/.json/.parquet file as dicts; FileNotFoundError / ValueError naming the file
    (and line) for a missing path, a folder, non-UTF-8 bytes or bad JSON."""
    if path is None or str(path).strip() in ("", "???"):
        raise ValueError("no dataset file given")
    p = Path(path).expanduser()
    if p.is_dir():
        raise ValueError(
            f"dataset path {str(p)!r} is a directory; it must name a .jsonl, .json or .parquet file"
        )
    if not p.exists():
        raise FileNotFoundError(f"dataset file {str(p)!r} does not exist")
    if not p.is_file():
        raise ValueError(f"dataset path {str(p)!r} is not a regular file")
    suffix = p.suffix.lower()
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as exc:
            raise ImportError(
                f"reading {p} needs pyarrow: pip install pyarrow (or the [data] extra)"
            ) from exc
        try:
            return pq.read_table(str(p)).to_pylist()
        except Exception as exc:  # pyarrow's own error types
            raise ValueError(
                f"{p}: not a readable parquet file "
                f"({str(exc).splitlines()[0] if str(exc) else exc})"
            ) from None
    if suffix == ".json":
        raw = p.read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            line = raw.count(b"\n", 0, exc.start) + 1
            raise ValueError(
                f"{p}: line {line} is not UTF-8 text (byte offset {exc.start})"
            ) from None
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{p}: line {exc.lineno} is not valid JSON ({exc.msg})") from None
        if not isinstance(rows, list):
            raise ValueError(f"{p}: a .json dataset must hold a list of objects")
        return rows
    return [row for _, row in read_numbered_rows(p)]


def read_numbered_rows(path: str) -> List[tuple]:
    """(where, row) pairs: "line N" (physical line, blank lines counted) for .jsonl, "row N" for
    .json / .parquet."""
    p = Path(path).expanduser()
    if p.suffix.lower() in (".json", ".parquet") or not p.is_file():
        return [(f"row {i}", row) for i, row in enumerate(read_rows(path), start=1)]
    rows = []
    with p.open("rb") as fh:
        for lineno, raw_line in enumerate(fh, start=1):
            try:
                line = raw_line.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ValueError(
                    f"{p}: line {lineno} is not UTF-8 text (byte {exc.start} of the line)"
                ) from None
            if not line.strip():
                continue
            try:
                rows.append((f"line {lineno}", json.loads(line)))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{p}: line {lineno} is not valid JSON ({exc.msg})") from None
    return rows


def parse_reference(raw: Any, answer_format: str = "auto") -> Optional[str]:
    """The reference answer inside a dataset field, or None when there is none."""
    if answer_format not in ANSWER_FORMATS:
        raise ValueError(f"answer_format must be one of {ANSWER_FORMATS}, got {answer_format!r}")
    if raw is None:
        return None
    text = str(raw).strip()
    fmt = answer_format
    if fmt == "auto":
        fmt = "gsm8k" if "####" in text else "boxed" if "\\boxed" in text else "plain"
    if fmt == "gsm8k":
        if "####" not in text:
            return None
        text = text.rsplit("####", 1)[1].strip().replace(",", "")
    elif fmt == "boxed":
        text = extract_boxed(text) or ""
    return text or None


def load_problems(
    path: str,
    question_field: str = "question",
    answer_field: str = "answer",
    answer_format: str = "auto",
    prompt_suffix: str = BOXED_SUFFIX,
) -> List[Problem]:
    """Every row of ``path`` as a Problem; ValueError naming the file and 1-based row for one
    without a question or a parseable answer."""
    problems = []
    for where, row in read_numbered_rows(path):
        if not isinstance(row, dict):
            raise ValueError(f"{path}: {where} is a {type(row).__name__}, expected an object")
        question = row.get(question_field)
        if question is not None and not isinstance(question, str):
            raise ValueError(
                f"{path}: {where}: field {question_field!r} holds a {type(question).__name__} "
                f"({str(question)[:40]!r}), not the question's text"
            )
        if question is None or not question.strip():
            raise ValueError(f"{path}: {where} has no question in field {question_field!r}")
        answer = parse_reference(row.get(answer_field), answer_format)
        if answer is None:
            raise ValueError(
                f"{path}: {where} has no answer in field {answer_field!r} "
                f"(answer_format={answer_format!r})"
            )
        i = int(where.split()[1])
        meta = {"row": i, "where": where, "source": str(path), "raw_answer": row.get(answer_field)}
        problems.append(
            Problem(prompt=str(question).strip() + prompt_suffix, answer=answer, meta=meta)
        )
    if not problems:
        raise ValueError(f"{path}: no rows")
    return problems


class MathDatasetTask(Task):
    """Problems from files; the eval set is ``eval_path``'s first ``n_eval`` rows, or without it
    ``n_eval`` (default 500) rows of ``train_path`` held out by a fixed ``seed`` shuffle. Either
    way a training row whose question the eval set holds is left out of training (a warning
    counts them): a file may repeat a question."""

    def __init__(
        self,
        train_path: str,
        eval_path: Optional[str] = None,
        *,
        question_field: str = "question",
        answer_field: str = "answer",
        answer_format: str = "auto",
        prompt_suffix: str = BOXED_SUFFIX,
        n_eval: Optional[int] = None,
        seed: int = 0,
        name: str = "math_file",
        reward_fn: Optional[str] = None,
    ) -> None:
        self.name = name
        self._reward_fn = load_reward_fn(reward_fn) if reward_fn else None
        read = dict(
            question_field=question_field,
            answer_field=answer_field,
            answer_format=answer_format,
            prompt_suffix=prompt_suffix,
        )
        if train_path is None or str(train_path).strip() in ("", "???"):
            raise ValueError(
                "task.params.train_path is required: the .jsonl/.json/.parquet file to train on "
                "(task.params.train_path=/data/train.jsonl)"
            )
        train = _load_named("task.params.train_path", train_path, read)
        warn_conflicting_answers("task.params.train_path", train)
        # The verifier's checkability of the references; a reward function of the user's judges them
        # itself.
        check = (lambda *a: 0) if self._reward_fn is not None else _check_references
        self.unusable_references = check("task.params.train_path", train_path, train, answer_field)
        if eval_path is not None:
            _refuse_same_file(train_path, eval_path)
            evals = _load_named("task.params.eval_path", eval_path, read)
            train = drop_overlap(train, evals, train_path, eval_path)
            self.unusable_references += check(
                "task.params.eval_path", eval_path, evals, answer_field
            )
            self._eval = evals if n_eval is None else evals[:n_eval]
            self._train = train
        else:
            n_eval = 500 if n_eval is None else n_eval
            check_count("n_eval", n_eval)
            if n_eval >= len(train):
                raise ValueError(
                    f"n_eval={n_eval} leaves no training rows in {train_path} ({len(train)} rows)"
                )
            order = list(range(len(train)))
            random.Random(seed).shuffle(order)
            held = sorted(order[:n_eval])
            held_set = set(held)
            self._eval = [train[i] for i in held]
            rest = [p for i, p in enumerate(train) if i not in held_set]
            self._train = drop_overlap(rest, self._eval, train_path, None)

    def finite_problems(self) -> Dict[str, List[Problem]]:
        return {"train": list(self._train), "eval": list(self._eval)}

    def drop_problems(self, drop) -> Dict[str, int]:
        before = {"train": len(self._train), "eval": len(self._eval)}
        self._train = [p for p in self._train if not drop(p)]
        self._eval = [p for p in self._eval if not drop(p)]
        if not self._train:
            raise ValueError(
                f"task {self.name!r}: no training rows left after dropping the ones that "
                "are too long"
            )
        if before["eval"] and not self._eval:  # it would log eval_reward_mean 0.0 of 0 rows
            raise ValueError(
                f"task {self.name!r}: no evaluation rows left after dropping the "
                f"{before['eval']} that are too long; shorten them or raise "
                "task.max_prompt_tokens"
            )
        return {
            "train": before["train"] - len(self._train),
            "eval": before["eval"] - len(self._eval),
        }

    def sample_train(self, n: int, rng: random.Random) -> List[Problem]:
        """``n`` distinct rows (rows repeat only when n exceeds the training set)."""
        check_count("n", n)
        rng = as_rng(rng)
        idx: List[int] = []
        while len(idx) < n:
            idx += rng.sample(range(len(self._train)), min(n - len(idx), len(self._train)))
        return [self._train[i] for i in idx]

    def eval_set(self) -> List[Problem]:
        return list(self._eval)

    def reward(self, problem: Problem, response_text: str) -> float:
        if self._reward_fn is not None:
            return float(self._reward_fn(response_text, problem.answer))
        return 1.0 if verify_math(extract_answer(response_text, "math"), problem.answer) else 0.0


def load_reward_fn(spec: str) -> Callable[[str, str], float]:
    """``"file.py:name"`` (relative to the working directory) or ``"module:name"`` -> the callable;
    errors name ``task.params.reward_fn``."""
    import importlib
    import importlib.util

    where, sep, attr = str(spec).rpartition(":")
    key = f"task.params.reward_fn={spec!r}"
    if not sep or not where or not attr:
        raise ValueError(f"{key}: expected 'file.py:function' or 'module:function'")
    if where.endswith(".py"):
        path = Path(where).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"{key}: no such file {str(path.resolve())!r}")
        module_spec = importlib.util.spec_from_file_location(
            f"nemo_d3s_user_reward_{path.stem}", path
        )
        module = importlib.util.module_from_spec(module_spec)
        try:
            module_spec.loader.exec_module(module)
        except (Exception, SystemExit) as exc:  # the user's file, run at load: name it
            raise ValueError(
                f"{key}: the reward file {str(path)!r} fails to load{_where(exc, path)}: "
                f"{type(exc).__name__}: {_first(exc)}; fix that file (the data was not read yet)"
            ) from None
    else:
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as exc:
            if exc.name != where and not where.startswith(f"{exc.name}."):
                raise ValueError(
                    f"{key}: importing {where!r} fails: {exc}; install that module or fix the "
                    "import"
                ) from None
            raise ValueError(
                f"{key}: cannot import {where!r} ({exc}); give a .py file or put its folder on "
                "PYTHONPATH"
            ) from None
        except (Exception, SystemExit) as exc:
            raise ValueError(
                f"{key}: importing {where!r} fails: {type(exc).__name__}: {_first(exc)}"
            ) from None
    if not hasattr(module, attr):
        raise ValueError(f"{key}: {where!r} has no function {attr!r}")
    fn = getattr(module, attr)
    if not callable(fn):
        raise ValueError(f"{key}: {where}:{attr} is a {type(fn).__name__}, not a function")
    check_reward_signature(fn, key)
    return fn


def check_reward_signature(fn: Callable, key: str) -> None:
    """ValueError at start-up when ``fn`` cannot be called as ``fn(response, answer)``."""
    import inspect

    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: trust it
        return
    try:
        sig.bind("response", "answer")
    except TypeError as exc:
        raise ValueError(
            f"{key}: the reward function is called as f(response, answer) but its signature is "
            f"{sig} ({exc})"
        ) from None


def _first(exc: BaseException) -> str:
    text = str(exc.code if isinstance(exc, SystemExit) else exc)
    return text.splitlines()[0] if text else "(no message)"


def _where(exc: BaseException, path: Path) -> str:
    """' (line N)' of the user's file where ``exc`` arose, when it did there."""
    import traceback

    if isinstance(exc, SyntaxError) and exc.lineno:
        return f" (line {exc.lineno})"
    target = str(path.resolve())
    lines = [
        f.lineno
        for f in traceback.extract_tb(exc.__traceback__)
        if str(Path(f.filename).resolve()) == target
    ]
    return f" (line {lines[-1]})" if lines else ""


def _refuse_same_file(train_path: str, eval_path: str) -> None:
    """Evaluating on the training file measures memorisation, not the method: refused."""
    a, b = Path(str(train_path)).expanduser(), Path(str(eval_path)).expanduser()
    try:
        same = a.resolve() == b.resolve() or (a.is_file() and b.is_file() and a.samefile(b))
    except OSError:
        same = False
    if same:
        raise ValueError(
            f"task.params.eval_path={str(eval_path)!r} is task.params.train_path: the evaluation "
            "would score the rows it trains on; name another file, or leave eval_path null to "
            "hold task.params.n_eval rows out of the training file"
        )


def _load_named(key: str, path: str, read: Dict[str, Any]) -> List[Problem]:
    """load_problems with the config key in the message of a missing or unreadable file."""
    try:
        return load_problems(path, **read)
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"{key}: {exc}") from None
    except ValueError as exc:
        msg = str(exc)
        raise ValueError(msg if key in msg else f"{key}: {msg}") from None


def _check_references(key: str, path: str, problems: List[Problem], answer_field: str) -> int:
    """Refuse a file with no reference the verifier can check; warn about (and count) the rows it
    cannot."""
    bad = [p for p in problems if not reference_is_checkable(p.answer)]
    if not bad:
        return 0
    shown = ", ".join(f"{p.meta.get('where', 'row')}: {p.answer!r}" for p in bad[:3]) + (
        " ..." if len(bad) > 3 else ""
    )
    if len(bad) == len(problems):
        raise ValueError(
            f"{key}: none of the {len(problems)} reference answers in {path} (field "
            f"{answer_field!r}) can be checked by the math verifier ({shown}); every "
            "rollout would get reward 0. Point task.params.answer_field / answer_format "
            "at the numeric or LaTeX answer"
        )
    log.warning(
        "%s: %d of %d reference answers in %s cannot be checked by the math verifier (%s); "
        "those rows train with reward 0 on every rollout (counted as unusable_references "
        "in summary.json)",
        key,
        len(bad),
        len(problems),
        path,
        shown,
    )
    return len(bad)


@TASKS.register("math_file")
def math_file_task(train_path: str, **options) -> MathDatasetTask:
    """Any GSM8K/MATH-style file: ``make_task("math_file", train_path=...,
    answer_field="solution")``."""
    return MathDatasetTask(train_path, **options)


@TASKS.register("gsm8k")
def gsm8k_task(train_path: str, eval_path: Optional[str] = None, **options) -> MathDatasetTask:
    """GSM8K JSONL (fields question / answer with "#### n" answers)."""
    options.setdefault("answer_format", "gsm8k")
    return MathDatasetTask(train_path, eval_path, name="gsm8k", **options)
