"""Observability of an RL run: TensorBoard scalars, a JSONL metrics file, end-of-run
plots (reward with held-out accuracy, and acceptance length, vs step).

Every step writes one JSON line ``{"step": t, ...scalars}`` to ``metrics.jsonl`` and
the same scalars to TensorBoard under ``<group>/<name>`` (the key's prefix before
``/``). Lists (per-position acceptance) become one scalar per position.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence

# A bare Figure renders without pyplot's global backend, so importing this module leaves
# a notebook's inline plotting alone.
from matplotlib.figure import Figure
import jax
import numpy as np
from tensorboardX import SummaryWriter

METRICS_FILE = "metrics.jsonl"
# Held-out accuracies the plots show (`eval.evaluate_source`'s keys).
EVAL_METRICS = ("pass@1_sampled", "pass@1_greedy")


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
  """Appends to ``run_dir/metrics.jsonl`` and TensorBoard ``run_dir/tb``.

  In a multi-process run only process 0 writes: every process computes the same
  metrics (the same host loop on replicated results), and one writer per file keeps
  the records whole."""

  def __init__(self, run_dir: str):
    self.run_dir = run_dir
    self.writes = jax.process_index() == 0
    if self.writes:
      self.writer = SummaryWriter(os.path.join(run_dir, "tb"))
      self.file = open(os.path.join(run_dir, METRICS_FILE), "a")

  def log(self, step: int, metrics: Mapping[str, object]) -> None:
    if not self.writes:
      return
    self.file.write(json.dumps({"step": step, **metrics}) + "\n")
    self.file.flush()
    for k, v in flatten(metrics).items():
      self.writer.add_scalar(k, v, step)

  def close(self) -> None:
    if self.writes:
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


def trend_window(n: int) -> int:
  """The moving average's window for a curve of ``n`` steps: a tenth of the run, at
  least 3 steps (a shorter window averages too little noise away)."""
  return max(3, n // 10)


def moving_average(steps: Sequence[float], values: Sequence[float],
                   window: int) -> np.ndarray:
  """Trailing moving average: at each point, the mean of the finite values whose step
  lies in ``(step - window, step]``.

  The window is over steps, not over points, so a missing step (a resumed run, an
  evaluation-only record) narrows the mean instead of reaching further back; the first
  points average what there is so far; NaNs are left out (NaN where a window holds
  none). Trailing, not centred: each point uses only the past, as a live run sees it.
  ``steps`` ascending.
  """
  steps = np.asarray(steps, float)
  values = np.asarray(values, float)
  finite = np.isfinite(values)
  sums = np.concatenate([[0.0], np.cumsum(np.where(finite, values, 0.0))])
  counts = np.concatenate([[0], np.cumsum(finite)])
  first = np.searchsorted(steps, steps - window, side="right")
  last = np.arange(1, len(steps) + 1)
  n = counts[last] - counts[first]
  with np.errstate(invalid="ignore", divide="ignore"):
    return np.where(n > 0, (sums[last] - sums[first]) / n, np.nan)


def draw_trend(ax, steps: Sequence[float], values: Sequence[float], window: int,
               color: str, label: str, x: Sequence[float] | None = None) -> np.ndarray:
  """Raw points faint and their `moving_average` bold on ``ax``, at ``x`` (default:
  the steps; e.g. seconds, the average still over steps). Returns the average."""
  x = steps if x is None else x
  trend = moving_average(steps, values, window)
  ax.plot(x, values, ".-", color=color, alpha=0.25, lw=0.8, ms=3, label=f"{label} (raw)")
  ax.plot(x, trend, "-", color=color, lw=2.2,
          label=f"{label} (trailing mean, {window} steps)")
  return trend


def held_out_accuracy(records: Sequence[Mapping]) -> dict[str, tuple[list, list]]:
  """``{"<task> <metric>": (steps, values)}`` of the held-out pass@1 values
  (``eval/<task>/pass@1_sampled`` and ``.../pass@1_greedy``) in ``records``."""
  series = {}
  for r in records:
    for key, v in r.items():
      parts = key.split("/")
      if parts[0] == "eval" and parts[-1] in EVAL_METRICS:
        steps, values = series.setdefault(f"{parts[1]} {parts[-1]}", ([], []))
        steps.append(r["step"])
        values.append(v)
  return series


def draw_held_out(ax, series: Mapping[str, tuple[list, list]], color: str | None = None,
                  label: str = "", x: Callable[[list], list] | None = None) -> None:
  """Held-out accuracy markers on ``ax``: sampled pass@1 circles on a solid line,
  greedy squares on a dashed one; one colour per series unless ``color``. ``x`` maps
  the evaluation steps to the axis (default: the steps)."""
  for i, (name, (steps, values)) in enumerate(sorted(series.items())):
    style = "o-" if name.endswith("sampled") else "s--"
    ax.plot(steps if x is None else x(steps), values, style, color=color or f"C{i + 2}",
            ms=5, label=f"{label}{name}")
  ax.set_ylabel("held-out accuracy")
  ax.set_ylim(-0.03, 1.03)


def plot_curves(run_dir: str) -> list[str]:
  """``reward.png`` (the rollout reward's trend over steps, the held-out accuracy at each
  evaluation below it) and ``acceptance_length.png`` into ``run_dir``, each where the
  history has its points; returns their paths."""
  records = read_metrics(run_dir)
  plots = (("rollout/reward_mean", "reward.png", held_out_accuracy(records)),
           ("spec/acceptance_length", "acceptance_length.png", {}))
  paths = []
  for key, name, held_out in plots:
    points = [(r["step"], r[key]) for r in records if key in r]
    if points:
      paths.append(plot_trend(os.path.join(run_dir, name), key, *zip(*points), held_out))
  return paths


def plot_trend(path: str, key: str, steps: Sequence[int], values: Sequence[float],
               held_out: Mapping[str, tuple[list, list]]) -> str:
  """One run's curve of ``key`` (raw and trend), with a held-out accuracy panel below
  when there were evaluations; writes ``path``."""
  fig = Figure(figsize=(6, 5.5 if held_out else 3.4))
  axes = fig.subplots(2 if held_out else 1, 1, sharex=True, squeeze=False)[:, 0]
  draw_trend(axes[0], steps, values, trend_window(len(steps)), "C0", key.split("/")[-1])
  axes[0].set_ylabel(key)
  if held_out:
    draw_held_out(axes[1], held_out)
    axes[1].set_title("held-out pass@1 at each evaluation", fontsize=9)
  for ax in axes:
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  axes[-1].set_xlabel("step")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  return path


def plot_timeline(path: str, lanes: Mapping[str, Sequence[Sequence[float]]]) -> str:
  """The wall-clock intervals ``[step, start, end]`` of each lane (rollouts, updates),
  one row of bars each, seconds from the first start; writes ``path``."""
  spans = [iv for ivs in lanes.values() for iv in ivs if np.isfinite(iv[2])]
  t0 = min((iv[1] for iv in spans), default=0.0)
  fig = Figure(figsize=(9, 0.6 + 0.6 * len(lanes)))
  ax = fig.subplots()
  for row, (name, ivs) in enumerate(lanes.items()):
    done = [(s - t0, e - s) for _, s, e in ivs if np.isfinite(e)]
    ax.broken_barh(done, (row - 0.35, 0.7), color=f"C{row}", edgecolor="white",
                   linewidth=0.3)
  ax.set_yticks(range(len(lanes)), list(lanes))
  ax.set_xlabel("wall-clock seconds")
  ax.grid(axis="x", alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  return path
