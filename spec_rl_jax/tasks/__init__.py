"""Built-in verifiable tasks and the registry that names them.

``get_task("arithmetic", max_digits=5)`` builds a task with the given difficulty; the
registry key is also the ``"task"`` field of the task's records, which is how the
reward function (`spec_rl_jax.rl.rewards`) finds the verifier of a record.
"""

from __future__ import annotations

import dataclasses

from spec_rl_jax.tasks.arithmetic import Arithmetic
from spec_rl_jax.tasks.base import Task
from spec_rl_jax.tasks.countdown import Countdown
from spec_rl_jax.tasks.counting import Counting
from spec_rl_jax.tasks.multiplication import Multiplication

TASKS: dict[str, type] = {"arithmetic": Arithmetic, "countdown": Countdown,
                          "counting": Counting, "multiplication": Multiplication}


def get_task(name: str, **difficulty) -> Task:
  """The task ``name`` with difficulty fields replaced; unknown fields are rejected."""
  if name not in TASKS:
    raise KeyError(f"unknown task {name!r}; known tasks: {sorted(TASKS)}")
  cls = TASKS[name]
  fields = {f.name for f in dataclasses.fields(cls)} - {"name"}
  unknown = set(difficulty) - fields
  if unknown:
    raise ValueError(f"task {name!r} has no parameter(s) {sorted(unknown)};"
                     f" its parameters are {sorted(fields)}")
  return cls(**difficulty)
