"""The simulator's printed table, JSON and PNG (the benchmark contract's shape:
``summary`` holds the headline ratios, ``rows`` every configuration's breakdown)."""

from __future__ import annotations

import dataclasses
import json
import os

PARTS = ("prefill", "verify", "draft", "rollout_idle", "reward", "learner", "transfer",
         "learner_idle")
COLUMNS = ["config", "tp", "rollout_chips", "slots", "step_s", "rollout_s", "prefill_s",
           "verify_s", "draft_s", "tail_s", "learner_s", "transfer_s", "idle_s",
           "k_rounds", "speedup"]


def rows_of(res: dict) -> list[dict]:
  """One row per (system, mode): the plan, the parts and the speedup over sync AR."""
  base = res["AR"]["sync"][1].step if "sync" in res.get("AR", {}) else None
  rows = []
  for system, modes in res.items():
    for mode, (plan, r) in modes.items():
      total_k = max(sum(r.rounds_at_k.values()), 1)
      rows.append({
          "config": f"{system} {mode}", "system": system, "mode": mode, "tp": plan.tp,
          "rollout_chips": plan.rollout_chips, "learner_chips": plan.learner_chips,
          "slots": plan.slots, "step_s": r.step, "rollout_s": r.rollout,
          "prefill_s": r.prefill, "verify_s": r.verify, "draft_s": r.draft, "tail_s": r.tail,
          "reward_s": r.reward, "learner_s": r.learner, "transfer_s": r.transfer,
          "rollout_idle_s": r.rollout_idle, "learner_idle_s": r.learner_idle,
          "idle_s": f"{r.rollout_idle:.3g}/{r.learner_idle:.3g}",
          "k_rounds": " ".join(f"{k}:{n / total_k:.0%}" for k, n in sorted(r.rounds_at_k.items())),
          "speedup": base / r.step if base else None,
          "step_times": r.step_times})
  return rows


def summary_of(rows: list[dict]) -> dict:
  """Headline ratios: each configuration's step (and rollout) speedup over sync AR."""
  by = {r["config"]: r for r in rows}
  out = {}
  if "AR sync" not in by:
    return out
  ar = by["AR sync"]
  for name, r in by.items():
    if name == "AR sync":
      continue
    tag = name.lower().replace(" ", "_")
    out[f"step_speedup_{tag}_vs_ar_sync"] = ar["step_s"] / r["step_s"]
    out[f"rollout_speedup_{tag}_vs_ar_sync"] = ar["rollout_s"] / r["rollout_s"]
  return out


def write(out: str, sc, res: dict, sweep: list[dict], plot: bool = True) -> dict:
  from spec_rl_jax.bench.common import print_table
  rows = rows_of(res)
  print(f"\n{sc.model} on {sc.hardware}: {sc.workload.requests} responses per step"
        f" (prompt {sc.workload.prompt_len}, mean length {sc.workload.mean_len:g}, max"
        f" {sc.workload.max_len}); idle = rollout pool / learner pool")
  print_table(rows, COLUMNS)
  summary = summary_of(rows)
  if sweep:
    print("\nSD speedup (step) vs model size, same hardware and workload")
    print_table(sweep, list(sweep[0]))
  result = {"bench": "sim", "scenario": _plain(sc), "summary": summary, "rows": rows,
            "size_sweep": sweep}
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  with open(out, "w") as f:
    json.dump(result, f, indent=2)
  print(f"\nwrote {out}")
  if plot:
    result["png"] = plot_results(out, rows, sweep, f"{sc.model} on {sc.hardware}")
  return result


def _plain(sc) -> dict:
  d = dataclasses.asdict(sc)
  d["workload"]["lengths"] = None if sc.workload.lengths is None else "recorded"
  return d


def plot_results(out: str, rows: list[dict], sweep: list[dict], title: str) -> str:
  """Stacked bars of each configuration's step (async: rollout and learner pools side
  by side) and the SD speedup vs model size; drawn on a bare ``Figure`` (no pyplot)."""
  from matplotlib.figure import Figure
  fig = Figure(figsize=(12, 4.5))
  ax, ax2 = fig.subplots(1, 2, gridspec_kw={"width_ratios": [3, 2]})
  rollout_parts = ("prefill_s", "verify_s", "draft_s", "rollout_idle_s")
  learner_parts = ("reward_s", "learner_s", "transfer_s", "learner_idle_s")
  labels, x = [], 0
  colors = {p: f"C{i}" for i, p in enumerate(rollout_parts + learner_parts)}
  seen = set()
  for r in rows:
    stacks = ([rollout_parts + learner_parts] if r["mode"] == "sync"
              else [rollout_parts, learner_parts])
    for j, parts in enumerate(stacks):
      bottom = 0.0
      for p in parts:
        ax.bar(x, r[p], bottom=bottom, color=colors[p],
               label=p[:-2] if p not in seen else None)
        seen.add(p)
        bottom += r[p]
      labels.append(r["config"] + ("" if r["mode"] == "sync" else
                                   (" (rollout)" if j == 0 else " (learner)")))
      x += 1
  ax.set_xticks(range(len(labels)), labels, rotation=20, fontsize=8)
  ax.set_ylabel("seconds per step")
  ax.set_title(title)
  ax.legend(fontsize=7)
  for key, style in (("speedup_sync", "o-"), ("speedup_async", "s--")):
    pts = sorted((r["params_b"], r[key]) for r in sweep if key in r)
    if pts:
      ax2.plot(*zip(*pts), style, label=key.replace("speedup_", "SD "))
  ax2.axhline(1.0, color="gray", lw=0.8)
  ax2.set_xscale("log")
  ax2.set_xlabel("total parameters (billions)")
  ax2.set_ylabel("step speedup vs AR sync")
  ax2.set_title("speedup vs model size")
  if sweep:
    ax2.legend(fontsize=8)
  fig.tight_layout()
  path = os.path.splitext(out)[0] + ".png"
  fig.savefig(path, dpi=110)
  print(f"wrote {path}")
  return path
