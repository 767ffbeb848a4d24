"""Shared benchmark plumbing: how every benchmark measures (docs/benchmarks.md).

* `alternate`: warm-up, then A B A B ... repetitions of several systems; medians and
  the median of per-pair ratios against a baseline.
* `machine_info`, `measure_bandwidth`: what the numbers were measured on.
* `write_results`, `print_table`, `save_plot`: the JSON contract, the printed table and
  the PNG next to the JSON.
* `torch_setup`: the ``transformers`` peers' device (the accelerator JAX runs on, if
  torch sees it) and speed settings.
"""

from __future__ import annotations

import json
import os
import pathlib
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np


def machine_info() -> dict:
  return {"backend": jax.default_backend(), "devices": jax.device_count(),
          "cpus": os.cpu_count(), "jax": jax.__version__,
          "device_kind": jax.devices()[0].device_kind}


def measure_bandwidth(nbytes: int = 512 * 1024**2, reps: int = 5) -> float:
  """Sustained read bandwidth (bytes/s) of the default device: a jitted sum over a
  buffer far larger than the caches, best of ``reps``."""
  x = jnp.ones((nbytes // 4,), jnp.float32)
  f = jax.jit(lambda a: jnp.sum(a))
  f(x).block_until_ready()
  best = float("inf")
  for _ in range(reps):
    t = time.perf_counter()
    f(x).block_until_ready()
    best = min(best, time.perf_counter() - t)
  return nbytes / best


def alternate(systems: dict[str, Callable[[], object]], reps: int, warmup: int = 1,
              baseline: str | None = None) -> dict:
  """Runs each system ``reps`` times, interleaved (A B A B ...) after ``warmup`` rounds.

  A system may return the work it did (e.g. tokens emitted); throughput is then
  ``work / time`` per run, else ``1 / time``. It may also return ``(work, seconds)``:
  seconds to leave out of its time (XLA compiles met in a timed run). Returns ``{"times": {name: [s...]},
  "median": {name: median s}, "rate": {name: median throughput}, "ratio": {name:
  median over repetitions of rate / baseline rate}}`` (ratio > 1: faster).
  """
  for _ in range(warmup):
    for fn in systems.values():
      fn()
  times = {name: [] for name in systems}
  rates = {name: [] for name in systems}
  for _ in range(reps):
    for name, fn in systems.items():
      t = time.perf_counter()
      work = fn()
      dt = time.perf_counter() - t
      if isinstance(work, tuple):
        work, excluded = work
        dt -= excluded
      times[name].append(dt)
      rates[name].append((work if isinstance(work, (int, float)) else 1.0) / dt)
  baseline = baseline or next(iter(systems))
  return {
      "times": times,
      "median": {n: statistics.median(v) for n, v in times.items()},
      "rate": {n: statistics.median(v) for n, v in rates.items()},
      "ratio": {n: statistics.median(x / b for b, x in zip(rates[baseline], v))
                for n, v in rates.items()},
  }


def torch_setup() -> str:
  """Sets torch up as a user would for speed where JAX runs; returns the torch device.

  JAX on a GPU: ``"cuda"`` with TF32 matmuls (JAX's default precision for fp32 dots on
  GPUs, so both peers round alike). Otherwise ``"cpu"`` with one thread per core.
  """
  import torch
  if jax.default_backend() == "gpu" and torch.cuda.is_available():
    torch.set_float32_matmul_precision("high")
    return "cuda"
  torch.set_num_threads(os.cpu_count())
  return "cpu"


def torch_sync(device: str) -> None:
  """Waits for ``device``'s queued torch work (timings end when the work does)."""
  import torch
  if device == "cuda":
    torch.cuda.synchronize()


def default_out(bench: str) -> str:
  return str(pathlib.Path("results") / f"bench_{bench}.json")


def write_results(path: str, bench: str, quick: bool, summary: dict, rows: list[dict],
                  **extra) -> dict:
  result = {"bench": bench, "quick": quick, "machine": machine_info(), "summary": summary,
            "rows": rows, **extra}
  p = pathlib.Path(path)
  p.parent.mkdir(parents=True, exist_ok=True)
  p.write_text(json.dumps(result, indent=2, default=_jsonable))
  print(f"\nwrote {p}")
  return result


def save_plot(fig, out: str, **savefig_kw) -> str:
  """Saves matplotlib ``fig`` as the PNG next to the results JSON ``out``; its path."""
  path = os.path.splitext(out)[0] + ".png"
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=120, **savefig_kw)
  print(f"wrote {path}")
  return path


def _jsonable(x):
  if isinstance(x, (np.floating, np.integer)):
    return x.item()
  raise TypeError(f"not JSON serialisable: {type(x)}")


def print_table(rows: list[dict], columns: list[str]) -> None:
  """Prints ``rows`` (dicts) as an aligned text table over ``columns``."""
  cells = [[_fmt(r.get(c, "")) for c in columns] for r in rows]
  widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
  print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
  print("  ".join("-" * w for w in widths))
  for row in cells:
    print("  ".join(v.ljust(w) for v, w in zip(row, widths)))


def _fmt(v) -> str:
  if isinstance(v, float):
    return f"{v:.4g}" if abs(v) < 1000 else f"{v:.0f}"
  return str(v)
