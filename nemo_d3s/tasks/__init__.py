"""Prompts with verifiable rewards: ``make_task(name, **options)`` builds a registered task (tiny,
chain_sum, basic_arithmetic, gsm_symbolic, countdown, reasoning_gym, math_file, gsm8k);
``safe_reward`` makes a failing verifier cost one sample, not the run."""

from nemo_d3s.tasks.base import TASKS, Problem, Task, make_task, safe_reward

# Imported for their registrations.
from nemo_d3s.tasks import math_dataset as _math_dataset  # noqa: F401,E402
from nemo_d3s.tasks import reasoning_gym_tasks as _reasoning_gym  # noqa: F401,E402
from nemo_d3s.tasks import tiny as _tiny  # noqa: F401,E402

__all__ = ["TASKS", "Problem", "Task", "make_task", "safe_reward"]
