"""Observability of an RL run: TensorBoard scalars, a JSONL metrics file, end-of-run
plots (reward and acceptance length vs step).

Every step writes one JSON line ``{"step": t, ...scalars}`` to ``metrics.jsonl`` and
the same scalars to TensorBoard under ``<group>/<name>`` (the key's prefix before
``/``). Lists (per-position acceptance) become one scalar per position.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

# A bare Figure renders without pyplot's global backend, so importing this module leaves
# a notebook's inline plotting alone.
from matplotlib.figure import Figure
from tensorboardX import SummaryWriter

METRICS_FILE = "metrics.jsonl"
PLOTS = (("rollout/reward_mean", "reward.png"),
         ("spec/acceptance_length", "acceptance_length.png"))


def flatten(metrics: Mapping[str, object]) -> dict[str, float]:
  """Scalars as they are, lists as ``name/0``, ``name/1``, ..."""
  out = {}
  for k, v in metrics.items():
    if isinstance(v, (list, tuple)):
      out.update({f"{k}/{i}": float(x) for i, x in enumerate(v)})
    else:
      out[k] = float(v)
  return out


class MetricsLogger:
  """Appends to ``run_dir/metrics.jsonl`` and TensorBoard ``run_dir/tb``."""

  def __init__(self, run_dir: str):
    self.run_dir = run_dir
    self.writer = SummaryWriter(os.path.join(run_dir, "tb"))
    self.file = open(os.path.join(run_dir, METRICS_FILE), "a")

  def log(self, step: int, metrics: Mapping[str, object]) -> None:
    self.file.write(json.dumps({"step": step, **metrics}) + "\n")
    self.file.flush()
    for k, v in flatten(metrics).items():
      self.writer.add_scalar(k, v, step)

  def close(self) -> None:
    self.file.close()
    self.writer.close()


def read_metrics(run_dir: str) -> list[dict]:
  """One record per logged step: the records of a step merged (training metrics and an
  evaluation logged at the same step), a resumed run's repeated values the latest."""
  by_step = {}
  with open(os.path.join(run_dir, METRICS_FILE)) as f:
    for line in f:
      record = json.loads(line)
      by_step.setdefault(record["step"], {}).update(record)
  return [by_step[s] for s in sorted(by_step)]


def plot_curves(run_dir: str) -> list[str]:
  """PNG plots of `PLOTS` vs step into ``run_dir``; returns their paths."""
  records = read_metrics(run_dir)
  paths = []
  for key, name in PLOTS:
    points = [(r["step"], r[key]) for r in records if key in r]
    if not points:
      continue
    fig = Figure(figsize=(5, 3.2))
    ax = fig.subplots()
    ax.plot(*zip(*points), marker=".")
    ax.set_xlabel("step")
    ax.set_ylabel(key)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = os.path.join(run_dir, name)
    fig.savefig(path, dpi=100)
    paths.append(path)
  return paths
