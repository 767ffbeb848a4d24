"""Reward functions: plain Python on the host, ``(response, answer) -> float``.

A record's ``"task"`` field picks the reward (`reward_for`): the built-in tasks' own
verifiers, or ``"math"`` — `math_reward`, built on ``math-verify`` — for free-form
math answers in the GSM8K (``#### 72``) and MATH (``\\boxed{...}``) styles. Records
without a ``"task"`` field (a user's JSONL) get the caller's default, ``"math"``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence

import math_verify

from spec_rl_jax.tasks import TASKS, get_task
from spec_rl_jax.tasks.base import final_answer

RewardFn = Callable[[str, str], float]


def _gold_candidates(answer: str) -> list:
  """Parses a reference answer: the text after ``####`` if present, else all of it.

  A reference without math delimiters is read as LaTeX inside ``$...$`` first (bare,
  ``1+x^2`` would extract just ``1``; MATH's ``\\frac{1}{2}`` would not parse).
  """
  text = final_answer(answer)
  text = answer if text is None else text
  delimited = any(d in text for d in ("$", "\\boxed", "\\(", "\\["))
  gold = math_verify.parse(text if delimited else f"${text}$", **_parse_kw())
  return gold or math_verify.parse(text, **_parse_kw())


def _prediction(response: str) -> str:
  """The part of a response to grade: after the last ``####`` if any, else all of it.

  ``\\$`` (an escaped dollar, i.e. currency in LaTeX text) is dropped: math-verify
  reads it as a broken math delimiter and would extract nothing.
  """
  text = final_answer(response)
  text = response if text is None else text
  return text.replace("\\$", "")


def _parse_kw() -> dict:
  """math-verify times out with ``signal.alarm``, which works only on the main thread;
  elsewhere (e.g. a reward thread pool) it must run without a timeout."""
  main = threading.current_thread() is threading.main_thread()
  return {} if main else {"parsing_timeout": None}


def _verify_kw() -> dict:
  main = threading.current_thread() is threading.main_thread()
  return {} if main else {"timeout_seconds": None}


def math_reward(response: str, answer: str) -> float:
  """1.0 iff ``math-verify`` finds the response's answer equivalent to the reference."""
  gold = _gold_candidates(answer)
  if not gold:
    raise ValueError(f"math-verify cannot parse the reference answer {answer!r}")
  pred = math_verify.parse(_prediction(response), **_parse_kw())
  if not pred:
    return 0.0
  return float(math_verify.verify(gold, pred, **_verify_kw()))


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
  """The reward of ``response`` to ``record``, by the record's ``"task"`` field."""
  return get_reward(record.get("task", default))(response, record["answer"])


def batch_rewards(records: Sequence[Mapping[str, str]], responses: Sequence[str],
                  default: str = "math") -> list[float]:
  if len(records) != len(responses):
    raise ValueError(f"{len(records)} records but {len(responses)} responses")
  return [reward_for(r, s, default) for r, s in zip(records, responses)]
