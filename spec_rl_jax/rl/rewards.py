"""Reward functions: plain Python on the host, ``(response, answer) -> float``.

A record's ``"task"`` field picks the reward (`reward_for`): the built-in tasks' own
verifiers, or ``"math"`` — `math_reward`, built on ``math-verify`` — for free-form
math answers in the GSM8K (``#### 72``) and MATH (``\\boxed{...}``) styles. Records
without a ``"task"`` field (a user's JSONL) get the caller's default, ``"math"``.

`score_batch` adds the optional format reward: ``r = correct + w · well_formed`` with
``w`` = ``data.format_weight``; a task with a worked-solution grammar (a
``well_formed(response)`` method) is checked against it, any other record needs only
a final answer after ``####``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from spec_rl_jax.tasks import TASKS, get_task
from spec_rl_jax.tasks.base import final_answer
from spec_rl_jax.tasks.math_answer import math_reward, readable

RewardFn = Callable[[str, str], float]


def _task_reward(name: str) -> RewardFn:
  """The verifier of built-in task ``name`` (difficulty does not affect verification)."""
  return get_task(name).verify


REWARDS: dict[str, RewardFn] = {"math": math_reward,
                                **{name: _task_reward(name) for name in TASKS}}


def get_reward(name: str) -> RewardFn:
  if name not in REWARDS:
    raise KeyError(f"unknown reward {name!r}; known rewards: {sorted(REWARDS)}")
  return REWARDS[name]


def reward_for(record: Mapping[str, str], response: str, default: str = "math") -> float:
  """The correctness of ``response`` to ``record``, by the record's ``"task"`` field."""
  return get_reward(record.get("task", default))(response, record["answer"])


def well_formed(record: Mapping[str, str], response: str) -> bool:
  """The record's task grammar (`well_formed` of the task) where it has one, else
  whether the response ends in a non-empty final answer."""
  name = record.get("task")
  check = getattr(get_task(name), "well_formed", None) if name in TASKS else None
  return check(response) if check is not None else bool(final_answer(response))


@dataclasses.dataclass(frozen=True)
class Scores:
  """Per-response ``[N]`` arrays: ``reward`` (what the learner sees), ``correct``,
  ``well_formed`` and ``readable`` (math-verify extracts an answer at all)."""

  reward: np.ndarray
  correct: np.ndarray
  well_formed: np.ndarray
  readable: np.ndarray


def score_batch(records: Sequence[Mapping[str, str]], responses: Sequence[str],
                default: str = "math", format_weight: float = 0.0) -> Scores:
  """Scores ``responses[i]`` against ``records[i]``; unreadable answers score 0."""
  if len(records) != len(responses):
    raise ValueError(f"{len(records)} records but {len(responses)} responses")
  correct = np.array([reward_for(r, s, default) for r, s in zip(records, responses)],
                     np.float32)
  formed = np.array([well_formed(r, s) for r, s in zip(records, responses)], bool)
  return Scores(reward=correct + np.float32(format_weight) * formed, correct=correct,
                well_formed=formed, readable=np.array([readable(s) for s in responses], bool))
