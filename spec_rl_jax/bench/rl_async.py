"""Sync vs async RL, side by side: ``python -m spec_rl_jax.bench.rl --mode MODES``.

``MODES`` is a comma-separated list of ``sync``, ``async`` (staleness 1) and
``async:N`` (staleness N), and must hold ``sync``, the baseline: e.g. ``--mode
sync,async`` or ``--mode sync,async:1,async:2``. Every mode runs the recipe (its
speculative rollouts included) for ``--steps`` steps on each of ``--seeds``; async runs
train with ``learner.loss=decoupled_ppo`` (it corrects the staleness, rl/losses.py),
sync with the recipe's loss (at staleness 0 decoupled PPO is PPO-clip).

How it measures. An async trainer's rollout thread runs while its learner updates, so
two trainers' steps cannot interleave in one thread as ``bench.rl``'s AR/SD runs do
(the rollout thread would run during the other trainer's step): each (seed, mode) run
goes whole, one after the other, the order of the modes reversed on every other seed
so that machine drift hits all modes alike. A run saves no checkpoint and evaluates
nothing: its only barrier is its end, so every step but the first overlaps.

Reported per mode (warm steps: all but each run's first, which compiles):

* the median step time, and the median over (seed, step) pairs of the ratio sync
  step time / mode step time (> 1: faster than sync), XLA compiles taken out
  (`rl.learner_net_s`: the update's, and the rollout's the learner sat through) and,
  apart, left in;
* the mean rollout busy and learner idle fractions of a step (the trainer's
  ``time/{rollout_busy,learner_idle}_frac``), and the learner idle time removed,
  ``1 - idle_mode / idle_sync`` over the seconds the learners waited for rollouts
  (compiles taken out; the issue's target: >= 80% at staleness 1; and with them left
  in: a rollout meeting a new decode shape makes even an async learner wait); the overlap
  achieved, the fraction of rollout seconds spent while an update ran (from the runs'
  timelines, kept in the JSON);
* the staleness histogram and mean (per response, its oldest token) and the
  importance weights' mean, max and truncated fraction (decoupled PPO);
* the reward curves, and the difference of each mode's final reward (mean of a run's
  last third of steps, averaged over seeds) from sync's next to the seed-to-seed
  standard deviation of the final reward: async should be indistinguishable.

JSON (``--out``; ``steps``: every step's record, ``timelines``: every run's rollout
and update intervals), a printed table, ``rl_modes_reward_curves.png`` and one
``rl_timeline_<mode>.png`` per mode (its first seed's run) next to the JSON.
"""

from __future__ import annotations

import dataclasses
import pathlib
import statistics

import numpy as np

from spec_rl_jax.bench import common
from spec_rl_jax.bench.rl import (STEP_FIELDS, Plan, final_reward, interleave,
                                  learner_net_s, learner_wait_s, plot_runs, seed_std, split,
                                  variant)
from spec_rl_jax.config import RLConfig, TrainConfig
from spec_rl_jax.rl.metrics import plot_timeline
from spec_rl_jax.train import Trainer

# What the JSON keeps of every step: bench.rl's fields, the pipeline's and, where the
# loss weighs tokens by importance (decoupled PPO), the weights' statistics.
MODE_STEP_FIELDS = STEP_FIELDS + (
    "time/rollout_busy_frac", "rl/staleness_hist", "rl/staleness_mean", "rl/staleness_max")
IW_FIELDS = ("train/iw_mean", "train/iw_max", "train/iw_truncated_frac")
ASYNC_LOSS = "decoupled_ppo"


def parse_modes(text: str) -> dict[str, tuple[str, int]]:
  """``sync,async,async:2`` → ``{"sync": ("sync", 0), "async:1": ("async", 1),
  "async:2": ("async", 2)}`` (name: (``rl.mode``, ``rl.max_staleness``))."""
  modes = {}
  for item in text.split(","):
    mode, _, n = item.strip().partition(":")
    if mode not in ("sync", "async") or (mode == "sync" and n) or (n and not n.isdigit()):
      raise ValueError(f"bad mode {item!r} in --mode {text!r}: expected sync, async or"
                       " async:N (N >= 0)")
    N = int(n or mode == "async")
    name = "sync" if mode == "sync" else f"async:{N}"
    if name in modes:
      raise ValueError(f"mode {name!r} given twice in --mode {text!r}")
    modes[name] = (mode, N)
  if "sync" not in modes:
    raise ValueError(f"--mode {text!r} has no sync: the baseline the modes compare to")
  return modes


def key(name: str) -> str:
  """A mode's name in summary keys: ``sync``, ``async1``."""
  return name.replace(":", "")


def mode_config(base: TrainConfig, run_dir: str, mode: tuple[str, int], seed: int,
                steps: int) -> TrainConfig:
  """``base`` (its rollouts: the recipe's drafts) in RL ``mode``, for ``steps`` steps
  with no barrier but the last (``checkpoint.every = steps``: a checkpoint would stop
  the overlap for a step; `Trainer.train_step` saves none)."""
  cfg = variant(base, run_dir, base.drafter.num_draft_tokens, seed)
  learner = (cfg.learner if mode[0] == "sync"
             else dataclasses.replace(cfg.learner, loss=ASYNC_LOSS))
  return dataclasses.replace(cfg, steps=steps, rl=RLConfig(*mode), learner=learner,
                             checkpoint=dataclasses.replace(cfg.checkpoint, every=steps))


def overlap(timeline: dict) -> float:
  """The fraction of the rollout seconds of steps >= 1 (the first has nothing to overlap
  with) spent while an update ran; ``timeline``: ``{"rollout": [[step, start, end],
  ...], "update": [...], ...}``."""
  rollouts = [(s, e) for t, s, e in timeline["rollout"] if t >= 1]
  total = sum(e - s for s, e in rollouts)
  shared = sum(max(0.0, min(e, ue) - max(s, us))
               for s, e in rollouts for _, us, ue in timeline["update"])
  return shared / total if total else 0.0


def iw_stats(steps: list[dict]) -> dict:
  """The importance weights' mean, max and truncated fraction over a mode's steps
  (``None``: its loss has none)."""
  if "iw_mean" not in steps[0]:
    return dict.fromkeys(("iw_mean", "iw_max", "iw_truncated_frac"))
  return {"iw_mean": float(np.mean([r["iw_mean"] for r in steps])),
          "iw_max": max(r["iw_max"] for r in steps),
          "iw_truncated_frac": float(np.mean([r["iw_truncated_frac"] for r in steps]))}


def run_mode(cfg: TrainConfig, name: str) -> tuple[list[dict], dict]:
  """One whole run: its step records and its timeline (`overlap`)."""
  trainer = Trainer(cfg)
  try:
    records = interleave({name: trainer}, cfg.steps)[name]
  finally:
    trainer.close()
  return records, {"rollout": trainer.pipeline.rollouts, "update": trainer.pipeline.updates}


def run_modes(base: TrainConfig, plan: Plan, modes: dict[str, tuple[str, int]], tmp: str
              ) -> tuple[list[dict], list[dict], list[dict]]:
  """Every (seed, mode) run, whole, the mode order reversed on every other seed.
  Returns (per-run rows, step records, timelines: ``{"seed", "system", "rollout",
  "update"}`` per run)."""
  rows, steps, timelines = [], [], []
  for i, seed in enumerate(plan.seeds):
    for name in (list(modes) if i % 2 == 0 else list(modes)[::-1]):
      cfg = mode_config(base, f"{tmp}/modes/{key(name)}_{seed}", modes[name], seed,
                        plan.steps)
      records, timeline = run_mode(cfg, name)
      timelines.append({"seed": seed, "system": name, **timeline})
      rewards = [r["rollout/reward_mean"] for r in records]
      rows.append({"case": "runs", "seed": seed, "system": name, "loss": cfg.learner.loss,
                   **split(records), "reward_final": final_reward(rewards)})
      steps += [{"seed": seed, "system": name, "step": t + 1,
                 **{k.split("/")[1]: r[k] for k in MODE_STEP_FIELDS + IW_FIELDS if k in r}}
                for t, r in enumerate(records)]
      print(f"  seed {seed} {name}: median step {rows[-1]['step_s']:.2f} s,"
            f" final reward {rows[-1]['reward_final']:.3f}", flush=True)
  return rows, steps, timelines


def compare(steps: list[dict], timelines: list[dict], modes: list[str]
            ) -> tuple[list[dict], dict]:
  """Per-mode rows and the summary, from the JSON's step records and timelines alone."""
  seeds = sorted({r["seed"] for r in steps})
  runs = {(name, seed): sorted((r for r in steps if r["system"] == name and r["seed"] == seed),
                               key=lambda r: r["step"])
          for name in modes for seed in seeds}
  warm = {name: [r for seed in seeds for r in runs[name, seed][1:]] for name in modes}
  finals = {name: [final_reward([r["reward_mean"] for r in runs[name, seed]])
                   for seed in seeds] for name in modes}
  std = seed_std(finals)
  idle_s = {name: sum(learner_wait_s(r) - min(r["rollout_compile_s"], learner_wait_s(r))
                      for r in warm[name]) for name in modes}
  idle_wall_s = {name: sum(learner_wait_s(r) for r in warm[name]) for name in modes}
  removed = lambda idle, name: 1.0 - idle[name] / idle["sync"] if idle["sync"] else None
  rows, summary = [], {"async_loss": ASYNC_LOSS, "final_reward_seed_std": std}
  for name in modes:
    every = [r for seed in seeds for r in runs[name, seed]]
    pairs = list(zip(warm["sync"], warm[name]))
    row = {
        "case": "modes", "system": name,
        "step_s": statistics.median(r["step_s"] for r in warm[name]),
        "net_step_s": statistics.median(learner_net_s(r) for r in warm[name]),
        "step_speedup_vs_sync": statistics.median(learner_net_s(s) / learner_net_s(m)
                                                  for s, m in pairs),
        "step_speedup_vs_sync_incl_compile": statistics.median(s["step_s"] / m["step_s"]
                                                               for s, m in pairs),
        "rollout_busy_frac": float(np.mean([r["rollout_busy_frac"] for r in warm[name]])),
        "learner_idle_frac": float(np.mean([r["learner_idle_frac"] for r in warm[name]])),
        "learner_idle_s": idle_s[name] / len(warm[name]),
        "learner_idle_removed": removed(idle_s, name),
        "learner_idle_removed_incl_compile": removed(idle_wall_s, name),
        "overlap": float(np.mean([overlap(t) for t in timelines if t["system"] == name])),
        "staleness_hist": np.mean([r["staleness_hist"] for r in every], axis=0).tolist(),
        "staleness_mean": float(np.mean([r["staleness_mean"] for r in every])),
        "staleness_max": max(r["staleness_max"] for r in every),
        **iw_stats(every),
        "reward_final": float(np.mean(finals[name])),
        "reward_diff_vs_sync": float(np.mean(finals[name]) - np.mean(finals["sync"])),
    }
    rows.append(row)
    if name == "sync":
      summary["final_reward_sync"] = row["reward_final"]
      continue
    k = key(name)
    summary.update({
        f"step_speedup_{k}_vs_sync": row["step_speedup_vs_sync"],
        f"step_speedup_{k}_vs_sync_incl_compile": row["step_speedup_vs_sync_incl_compile"],
        f"learner_idle_removed_{k}_vs_sync": row["learner_idle_removed"],
        f"learner_idle_removed_{k}_vs_sync_incl_compile": row[
            "learner_idle_removed_incl_compile"],
        f"rollout_overlap_{k}": row["overlap"],
        f"final_reward_{k}": row["reward_final"],
        f"final_reward_diff_{k}_minus_sync": row["reward_diff_vs_sync"],
        f"final_reward_diff_{k}_over_seed_std": row["reward_diff_vs_sync"] / std if std else None,
    })
  return rows, summary


def main(base: TrainConfig, plan: Plan, modes_text: str, tmp: str, out: str, quick: bool,
         recipe: str) -> dict:
  """Runs the comparison (``bench.rl``'s ``--mode``), prints it, writes JSON and plots;
  returns the summary."""
  modes = parse_modes(modes_text)
  run_rows, steps, timelines = run_modes(base, plan, modes, tmp)
  rows, summary = compare(steps, timelines, list(modes))
  summary.update(recipe=recipe, proposer=base.drafter.proposer,
                 num_draft_tokens=base.drafter.num_draft_tokens)
  print(f"\nmodes: {base.rollout.prompts_per_step}x{base.rollout.group_size} responses,"
        f" max_new_tokens {base.rollout.max_new_tokens}, seeds {list(plan.seeds)},"
        f" {plan.steps} steps; async runs train with learner.loss={ASYNC_LOSS}, sync"
        f" with {base.learner.loss}")
  common.print_table(rows, ["system", "step_s", "net_step_s", "step_speedup_vs_sync",
                            "rollout_busy_frac", "learner_idle_frac", "learner_idle_s",
                            "learner_idle_removed", "learner_idle_removed_incl_compile",
                            "overlap", "staleness_mean", "iw_mean",
                            "iw_max", "iw_truncated_frac", "reward_final",
                            "reward_diff_vs_sync"])
  std = summary["final_reward_seed_std"]
  print(f"final reward seed-to-seed std: {'n/a (one seed)' if std is None else f'{std:.3f}'}")
  result = common.write_results(out, "rl_modes", quick, summary, run_rows + rows,
                                steps=steps, timelines=timelines,
                                plan=dataclasses.asdict(plan))
  folder = pathlib.Path(out).parent
  paths = [plot_runs(str(folder / "rl_modes_reward_curves.png"), steps, [], tuple(modes),
                     "GRPO rollout reward, sync vs async RL (speculative rollouts)")]
  for t in timelines:
    if t["seed"] == plan.seeds[0]:
      paths.append(plot_timeline(str(folder / f"rl_timeline_{key(t['system'])}.png"),
                                 {"rollout": t["rollout"], "update": t["update"]}))
  for p in paths:
    print(f"wrote {p}")
  return result["summary"]
