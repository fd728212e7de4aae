"""A reward function of your own, for a JSONL dataset (README: "Use your own model, data and
reward"):

    python -m nemo_d3s.train task=jsonl_math task.params.train_path=examples/data/sums.jsonl \
        task.params.answer_format=plain task.params.reward_fn=examples/reward_last_number.py:score

The trainer imports this file once (``file.py:function``, relative to the working directory;
``package.module:function`` works for a module on the Python path) and calls
``score(response, answer)`` for every sampled response: ``response`` is the model's text,
``answer`` the row's answer field (as written, with ``answer_format=plain``). Return a float
in [0, 1]; an exception or a NaN costs that one sample a reward of 0 and is counted
(``reward_errors`` in metrics.jsonl), it does not stop the run.
"""

import re


def score(response: str, answer: str) -> float:
    """1 when the last number in the response is the answer, 0.2 when the answer appears
    earlier (partial credit: the model computed it but said something else last), else 0."""
    numbers = re.findall(r"-?\d+", response.replace(",", ""))
    if numbers and numbers[-1] == answer.strip():
        return 1.0
    return 0.2 if answer.strip() in numbers else 0.0
