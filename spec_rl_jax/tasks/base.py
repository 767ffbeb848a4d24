"""What every built-in task shares: records, the train/test split, generation, export.

A task is a frozen dataclass holding its difficulty parameters and providing

  * ``name``: the registry key and the ``"task"`` field of its records,
  * ``sample(rng) -> Problem``: one random problem,
  * ``verify(response, answer) -> float``: the reward, 1.0 for a correct response.

Records use the GSM8K schema a user's own dataset uses: ``{"prompt": question,
"answer": "<worked solution> #### <final answer>", "task": name}``. The full
``answer`` is the SFT target; verifiers compare only the part after the last
``####`` (`final_answer`).

Train and test never overlap: a problem's split is a hash of its canonical ``key``
(`split_of`), so it is fixed before any seed is drawn. Record ``i`` of a split is the
first problem drawn from ``rng((seed, split, i))`` that hashes into that split, which
makes the stream infinite, deterministic per seed and randomly addressable (grain
sources need ``__getitem__``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import re
from collections.abc import Iterator
from typing import Protocol

import numpy as np

SPLITS = ("train", "test")
TEST_FRACTION = 0.1  # share of the problem space reserved for the test split
FINAL_MARKER = "####"


@dataclasses.dataclass(frozen=True)
class Problem:
  """One generated problem.

  ``key`` is canonical (equal problems have equal keys) and decides the split;
  ``solution`` is the worked solution without the final answer.
  """

  key: str
  prompt: str
  solution: str
  final: str

  def record(self, task: str) -> dict[str, str]:
    return {"prompt": self.prompt, "answer": f"{self.solution} {FINAL_MARKER} {self.final}",
            "task": task}


class Task(Protocol):
  name: str

  def sample(self, rng: np.random.Generator) -> Problem:
    ...

  def verify(self, response: str, answer: str) -> float:
    ...


def split_of(key: str) -> str:
  """``"test"`` for a fixed ``TEST_FRACTION`` of problem keys, ``"train"`` otherwise."""
  h = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
  return "test" if h / 2.0**64 < TEST_FRACTION else "train"


def _check_split(split: str) -> None:
  if split not in SPLITS:
    raise ValueError(f"split must be one of {SPLITS}, got {split!r}")


def problem_at(task: Task, split: str, seed: int, index: int) -> Problem:
  """Problem ``index`` of the ``split`` stream of ``seed`` (random access)."""
  _check_split(split)
  rng = np.random.default_rng((seed, SPLITS.index(split), index))
  while True:
    p = task.sample(rng)
    if split_of(p.key) == split:
      return p


def record_at(task: Task, split: str, seed: int, index: int) -> dict[str, str]:
  return problem_at(task, split, seed, index).record(task.name)


def iterate(task: Task, split: str, seed: int) -> Iterator[dict[str, str]]:
  """The infinite record stream of ``split`` for ``seed``."""
  _check_split(split)
  for i in itertools.count():
    yield record_at(task, split, seed, i)


def unique_records(task: Task, split: str, seed: int, n: int,
                   max_draws: int | None = None) -> list[dict[str, str]]:
  """The first ``n`` distinct problems of a stream (evaluation sets).

  Raises when the split's problem space runs out within ``max_draws`` draws
  (default ``50 * n``), e.g. asking for 1000 test problems of 1-digit addition.
  """
  seen: set[str] = set()
  out = []
  for i in range(max_draws or 50 * n):
    p = problem_at(task, split, seed, i)
    if p.key not in seen:
      seen.add(p.key)
      out.append(p.record(task.name))
      if len(out) == n:
        return out
  raise ValueError(f"{task.name} {split}: only {len(out)} distinct problems in"
                   f" {max_draws or 50 * n} draws, {n} requested; raise the difficulty")


def export_jsonl(task: Task, path: str, split: str, n: int, seed: int = 0) -> int:
  """Writes ``n`` distinct records of ``split`` as JSONL; returns the count."""
  records = unique_records(task, split, seed, n)
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    for r in records:
      f.write(json.dumps(r) + "\n")
  return len(records)


def final_answer(text: str) -> str | None:
  """The first line after the last ``####`` in ``text``, stripped; None if absent."""
  pos = text.rfind(FINAL_MARKER)
  if pos < 0:
    return None
  rest = text[pos + len(FINAL_MARKER):].strip()
  return rest.splitlines()[0].strip() if rest else ""


_NUMBER = re.compile(r"[+-]?(\d{1,3}(,\d{3})+|\d+)(\.0*)?")


def parse_int(text: str) -> int | None:
  """``"1,234"``, ``"+1234"``, ``"1234."`` and ``"1234.00"`` → 1234; else None."""
  text = text.strip()
  text = text[:-1] if text.endswith(".") else text
  if not _NUMBER.fullmatch(text):
    return None
  return int(text.replace(",", "").split(".")[0])
