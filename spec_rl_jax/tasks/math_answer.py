"""Grading free-form math answers with ``math-verify`` (GSM8K ``#### 72`` and MATH
``\\boxed{...}`` styles): the ``"math"`` reward and the built-in tasks that read their
final answer the same way."""

from __future__ import annotations

import threading

import math_verify

from spec_rl_jax.tasks.base import final_answer


def _parse_kw() -> dict:
  """math-verify times out with ``signal.alarm``, which works only on the main thread;
  elsewhere (e.g. a reward thread pool) it must run without a timeout."""
  main = threading.current_thread() is threading.main_thread()
  return {} if main else {"parsing_timeout": None}


def _verify_kw() -> dict:
  main = threading.current_thread() is threading.main_thread()
  return {} if main else {"timeout_seconds": None}


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


def readable(response: str) -> bool:
  """Whether math-verify extracts an answer from ``response`` at all (an unreadable
  answer scores 0; the trainer counts them apart from wrong ones)."""
  return bool(math_verify.parse(_prediction(response), **_parse_kw()))


def math_reward(response: str, answer: str) -> float:
  """1.0 iff ``math-verify`` finds the response's answer equivalent to the reference."""
  gold = _gold_candidates(answer)
  if not gold:
    raise ValueError(f"math-verify cannot parse the reference answer {answer!r}")
  pred = math_verify.parse(_prediction(response), **_parse_kw())
  if not pred:
    return 0.0
  return float(math_verify.verify(gold, pred, **_verify_kw()))
