"""Prompts with verifiable rewards. ``make_task(name, **options)`` builds a registered task;
``safe_reward`` wraps a task's reward so a failing verifier costs one sample, not the run.

Registered: tiny (CI toy), chain_sum, basic_arithmetic, gsm_symbolic, countdown,
reasoning_gym (any reasoning-gym dataset), math_file and gsm8k (local files).
"""

from nemo_d3s.tasks.base import TASKS, Problem, Task, make_task, safe_reward

# Imported for their registrations.
from nemo_d3s.tasks import math_dataset as _math_dataset  # noqa: F401,E402
from nemo_d3s.tasks import reasoning_gym_tasks as _reasoning_gym  # noqa: F401,E402
from nemo_d3s.tasks import tiny as _tiny  # noqa: F401,E402

__all__ = ["TASKS", "Problem", "Task", "make_task", "safe_reward"]
