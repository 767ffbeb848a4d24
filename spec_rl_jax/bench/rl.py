"""RL step time with AR vs speculative rollouts: ``python -m spec_rl_jax.bench.rl``.

The same short GRPO run (a recipe: the CPU default unless ``--config``) with AR
rollouts (``K = 0``) and with speculative rollouts (``drafter.num_draft_tokens`` from
the recipe's proposer: ``auto``, or a fixed K; the draft model by default), measured
side by side in one process:

  1. **runs** — for each seed, an AR and an SD trainer built from the same
     (config, seed) take their steps interleaved (AR SD, SD AR, AR SD, ...: machine
     noise hits both alike). Reported: the median step time split (rollout, reward,
     update; each trainer's first step, which compiles, reported apart), the median
     over steps of the per-step ratio AR time / SD time with each phase's XLA compile
     seconds taken out (end-to-end and rollout; and end-to-end per response token,
     since the two runs draw different responses whose lengths set a step's time):
     later steps still compile new shapes — micro-batch lengths, decode buckets — which
     a long run compiles once, so these are its steady state (`recipe_speedups`; the
     wall-clock ratios with the compiles left in are reported too), every step's
     record (``steps`` in the JSON), the reward curves, and the held-out accuracy of
     both before the first step, every ``eval_every`` steps and after the last
     (``held_out``; ``eval_n`` prompts per source, outside the timed steps). SD is
     lossless, so the curves must agree within seed noise: the summary gives the
     SD − AR difference of the final reward (mean of each run's last third of steps,
     averaged over seeds) next to the seed-to-seed standard deviation of that final
     reward.
  2. **sweep** — rollout batch ``N = prompts_per_step × group_size`` (decoded as one
     batch: ``num_slots = N``) × response length ``L = max_new_tokens``, with EOS
     ignored so every response has exactly ``L`` tokens (as in vLLM's ``ignore_eos``
     throughput benchmarks; the default policy itself stops after about 20 tokens).
     Per cell, AR and SD steps interleaved after one compiling step each: the
     end-to-end and rollout speedups (compile seconds taken out: a throughput map) and
     the rollout share of the AR step. Large batches make CPU decoding compute-bound
     (verifying K + 1 tokens costs about K + 1 times one) and long responses make the
     rollout a larger share of the step: the sweep shows both.

``--mode sync,async[:N],...`` compares RL modes (sync vs async at staleness N) instead,
all with the recipe's speculative rollouts: bench/rl_async.py.

``--quick`` (fewer seeds, steps and cells) produces every headline figure in a few
minutes; ``--seeds/--steps/--eval-n/--eval-every/--batches/--lengths/--sweep-steps``
replace the plan's fields (e.g. a long-response recipe, ``--config
configs/counting_long.yaml``, sweeps lengths in the thousands). JSON (``--out``), the
printed tables and PNG plots next to the JSON: ``rl_reward_curves.png`` (AR and SD
reward, raw and trailing mean, and held-out accuracy, against steps and against
training seconds) and ``rl_speedup.png`` (the sweep).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import statistics
import tempfile

import jax
import numpy as np
from matplotlib.figure import Figure
from tqdm import tqdm

from spec_rl_jax.bench import common
from spec_rl_jax.compiles import CompileCounter
from spec_rl_jax.config import TrainConfig, load_config
from spec_rl_jax.rl.metrics import (draw_held_out, draw_trend, held_out_accuracy,
                                    moving_average, trend_window)
from spec_rl_jax.rollout.engine import RolloutEngine
from spec_rl_jax.train import Trainer

PHASES = ("rollout", "reward", "update", "step")
# What the JSON keeps of every step of part 1 (``steps``), to re-derive any ratio.
STEP_FIELDS = ("time/rollout_s", "time/reward_s", "time/update_s", "time/step_s",
               "time/rollout_decode_s", "time/rollout_compile_s", "time/update_compile_s",
               "time/learner_idle_frac", "rollout/response_len", "rollout/reward_mean",
               "spec/acceptance_length")
SYSTEMS = ("AR", "SD")


@dataclasses.dataclass(frozen=True)
class Plan:
  seeds: tuple[int, ...]
  steps: int  # per run, the compiling first step included
  eval_n: int  # held-out prompts per source per evaluation (0: none)
  eval_every: int  # steps between evaluations (0: only before and after)
  batches: tuple[tuple[int, int], ...]  # sweep: (prompts_per_step, group_size)
  lengths: tuple[int, ...]  # sweep: max_new_tokens
  sweep_steps: int  # measured steps per system and cell (after one compiling step)


FULL = Plan(seeds=(0, 1, 2), steps=12, eval_n=50, eval_every=4,
            batches=((2, 8), (8, 8), (32, 8)), lengths=(32, 96), sweep_steps=2)
QUICK = Plan(seeds=(0, 1), steps=3, eval_n=16, eval_every=0, batches=((2, 4), (8, 4)),
             lengths=(16, 48), sweep_steps=1)


def variant(base: TrainConfig, run_dir: str, K: int | str, seed: int = 0,
            eval_n: int = 0) -> TrainConfig:
  """``base`` with ``K`` drafts (or ``auto``), rollout and data ``seed``, ``eval_n``
  held-out prompts per source (`Trainer.evaluate`; 0: no evaluation), no bar."""
  return dataclasses.replace(
      base, run_dir=run_dir, progress=False,
      drafter=dataclasses.replace(base.drafter, num_draft_tokens=K),
      rollout=dataclasses.replace(base.rollout, seed=seed),
      data=dataclasses.replace(base.data, seed=seed, eval_n=eval_n))


def sweep_config(base: TrainConfig, B: int, G: int, L: int) -> TrainConfig:
  """``base`` decoding ``B·G`` responses of ``L`` tokens as one batch."""
  r = base.rollout
  pages = -(-(r.max_prompt_len + L + base.drafter.k_max + 1) // r.page_size)
  N = B * G
  return dataclasses.replace(
      base, rollout=dataclasses.replace(r, prompts_per_step=B, group_size=G,
                                        max_new_tokens=L, num_slots=N,
                                        num_pages=N * pages + 8),
      learner=dataclasses.replace(base.learner, micro_batch_size=min(
          base.learner.micro_batch_size, N)))


def ignore_eos(trainer: Trainer) -> None:
  """Rebuilds the trainer's engine without EOS ids: responses run to ``L`` tokens."""
  e = trainer.engine
  trainer.engine = RolloutEngine(trainer.learner.model(),
                                 dataclasses.replace(e.config, eos_ids=()),
                                 trainer.tokenizer, trainer.proposer, e.controller)


def interleave(trainers: dict[str, Trainer], steps: int,
               progress: tqdm | None = None) -> dict[str, list[dict]]:
  """``steps`` train steps of every trainer, alternating which goes first; each
  record also holds ``compiles``, the XLA compiles the step ran (a step whose rollout
  or update meets new shapes: the learner compiles its gradient once per micro-batch
  length bucket); the trainer logs the seconds they took per phase
  (``time/<phase>_compile_s``). ``progress`` advances by one per trainer step."""
  bar = tqdm(disable=True)
  records = {name: [] for name in trainers}
  names = list(trainers)
  for t in range(steps):
    for name in (names if t % 2 == 0 else names[::-1]):
      with CompileCounter() as compiles:
        record = trainers[name].train_step(bar)
      records[name].append({**record, "compiles": compiles.count})
      if progress is not None:
        progress.update(1)
  return records


def interleave_evaluated(trainers: dict[str, Trainer], steps: int, every: int
                         ) -> tuple[dict[str, list[dict]], dict[str, list[dict]]]:
  """`interleave` in segments of ``every`` steps (0: one segment), every trainer
  evaluated on the held-out prompts before the first segment and after each one:
  ``(step records, {name: [{"step": t, "eval/<task>/<metric>": value, ...}]})``.
  Evaluations run between `Trainer.train_step` calls, so no step's timer holds one."""
  records = {name: [] for name in trainers}
  evals = {name: [] for name in trainers}
  done = 0
  while True:
    for name, tr in trainers.items():
      evals[name].append({"step": done, **tr.evaluate()})
    if done == steps:
      return records, evals
    segment = min(every or steps, steps - done)
    for name, part in interleave(trainers, segment).items():
      records[name] += part
    done += segment


def net_s(record: dict, phase: str) -> float:
  """A phase's time less the XLA compile seconds spent in it (``step``: in either)."""
  parts = ("rollout", "update") if phase == "step" else (phase,)
  return record[f"time/{phase}_s"] - sum(record[f"time/{p}_compile_s"] for p in parts)


def learner_net_s(step: dict) -> float:
  """A JSON step record's (``steps``) learner seconds less the XLA compiles it waited
  for: its update's, and of its rollout's only those the learner sat through (async: a
  rollout compiling during the previous update delays the learner by what is left of
  its compile when the update ends; sync: `net_s` of the step)."""
  return step["step_s"] - step["update_compile_s"] - min(step["rollout_compile_s"],
                                                         learner_wait_s(step))


def learner_wait_s(step: dict) -> float:
  """Seconds the step's learner waited for its rollouts (a JSON step record)."""
  return step["learner_idle_frac"] * step["step_s"]


def final_reward(rewards: list[float]) -> float:
  """A run's final reward: the mean of its last third of steps (at least one)."""
  return float(np.mean(rewards[-max(len(rewards) // 3, 1):]))


def seed_std(finals: dict[str, list[float]]) -> float | None:
  """The seed-to-seed standard deviation of the final reward, averaged over systems;
  ``None`` with one seed (a difference then has no scale to be read against)."""
  if len(next(iter(finals.values()))) < 2:
    return None
  return float(np.mean([np.std(f, ddof=1) for f in finals.values()]))


def split(records: list[dict]) -> dict:
  """Median phase times over the warm steps; the first (compiling) step apart."""
  warm = records[1:]
  return {**{f"{p}_s": statistics.median(r[f"time/{p}_s"] for r in warm) for p in PHASES},
          "first_step_s": records[0]["time/step_s"],
          "acceptance_length": float(np.mean([r["spec/acceptance_length"] for r in warm])),
          "response_len": float(np.mean([r["rollout/response_len"] for r in warm])),
          "tokens_per_s": statistics.median(r["rollout/tokens_per_s"] for r in warm),
          "compiling_steps": sum(r["compiles"] > 0 for r in warm),
          "compile_s": statistics.median(r["time/rollout_compile_s"] + r["time/update_compile_s"]
                                         for r in warm)}


def pair_ratio(pairs: list[tuple[dict, dict]], phase: str) -> float:
  """Median over ``(AR, SD)`` warm-step record pairs of ``AR time / SD time`` less
  compile seconds (> 1: SD faster)."""
  return statistics.median(net_s(a, phase) / net_s(b, phase) for a, b in pairs)


def _close(trainers: dict[str, Trainer]) -> None:
  for tr in trainers.values():
    tr.close()


def recipe_speedups(pairs: list[tuple[dict, dict]]) -> dict[str, float]:
  """Summary ratios ``AR / SD`` (> 1: SD faster) over ``(AR, SD)`` warm-step record
  pairs, each the median of the per-pair ratios.

  Throughput ratios take each phase's compile seconds out (`net_s`: compile time is
  reported apart, never mixed into throughput): a short run's
  warm steps still meet new shapes (micro-batch lengths, decode buckets) that a long
  run compiles once, and the SD engine's speculative rounds compile longer than AR
  steps. The wall-clock ratios with those compiles in are kept (``_incl_compile``).
  The AR and SD runs sample different responses (same distribution, other draws): with
  long, widely spread lengths a step's time follows its own lengths; per response
  token the two compare the same work.
  """
  med = lambda xs: statistics.median(list(xs))
  wall = lambda r, phase: r[f"time/{phase}_s"]
  per_token = lambda r: net_s(r, "step") / r["rollout/response_len"]
  return {
      "step_speedup_sd_vs_ar_recipe": pair_ratio(pairs, "step"),
      "rollout_speedup_sd_vs_ar_recipe": pair_ratio(pairs, "rollout"),
      "step_speedup_per_token_sd_vs_ar_recipe": med(per_token(a) / per_token(b)
                                                    for a, b in pairs),
      "step_speedup_sd_vs_ar_recipe_incl_compile": med(wall(a, "step") / wall(b, "step")
                                                       for a, b in pairs),
      "rollout_speedup_sd_vs_ar_recipe_incl_compile": med(
          wall(a, "rollout") / wall(b, "rollout") for a, b in pairs),
      "ar_rollout_share_recipe": med(net_s(a, "rollout") / net_s(a, "step") for a, _ in pairs),
  }


def run_seeds(base: TrainConfig, plan: Plan, tmp: str
              ) -> tuple[list[dict], dict, dict, list[dict], list[dict]]:
  """Part 1: AR and SD runs per seed. Returns (rows, summary entries, curves, per-step
  records, held-out evaluations)."""
  K = base.drafter.num_draft_tokens
  rows, curves, pairs, steps, held_out = [], {s: {} for s in SYSTEMS}, [], [], []
  finals = {s: [] for s in SYSTEMS}
  for seed in plan.seeds:
    trainers = {s: Trainer(variant(base, f"{tmp}/runs/{s}{seed}", k, seed, plan.eval_n))
                for s, k in zip(SYSTEMS, (0, K))}
    try:
      if plan.eval_n:
        records, evals = interleave_evaluated(trainers, plan.steps, plan.eval_every)
        held_out += [{"seed": seed, "system": s, **e} for s in SYSTEMS for e in evals[s]]
      else:
        records = interleave(trainers, plan.steps)
    finally:
      _close(trainers)
    for s in SYSTEMS:
      rewards = [r["rollout/reward_mean"] for r in records[s]]
      curves[s][seed] = rewards
      finals[s].append(final_reward(rewards))
      rows.append({"case": "runs", "seed": seed, "system": s, **split(records[s]),
                   "reward_mean": float(np.mean(rewards)), "reward_final": finals[s][-1]})
      steps += [{"seed": seed, "system": s, "step": i + 1,
                 **{k.split("/")[1]: r[k] for k in STEP_FIELDS}}
                for i, r in enumerate(records[s])]
    pairs += list(zip(records["AR"][1:], records["SD"][1:]))
  std = seed_std(finals)
  diff = float(np.mean(finals["SD"]) - np.mean(finals["AR"]))
  summary = {
      **recipe_speedups(pairs),
      "final_reward_ar": float(np.mean(finals["AR"])),
      "final_reward_sd": float(np.mean(finals["SD"])),
      "final_reward_diff_sd_minus_ar": diff,
      "final_reward_seed_std": std,
      "final_reward_diff_over_seed_std": diff / std if std else None,
  }
  return rows, summary, curves, steps, held_out


def run_sweep(base: TrainConfig, plan: Plan, tmp: str) -> tuple[list[dict], dict]:
  """Part 2: speedup over rollout batch × response length (EOS ignored)."""
  K = base.drafter.num_draft_tokens
  rows, summary = [], {}
  for L in plan.lengths:
    for B, G in plan.batches:
      cfg = sweep_config(base, B, G, L)
      trainers = {s: Trainer(variant(cfg, f"{tmp}/sweep/{s}_{B}x{G}_{L}", k))
                  for s, k in zip(SYSTEMS, (0, K))}
      try:
        for tr in trainers.values():
          ignore_eos(tr)
        records = interleave(trainers, plan.sweep_steps + 1)
      finally:
        _close(trainers)
      N = B * G
      cell = {"case": f"N={N},L={L}", "N": N, "L": L}
      stats = {s: split(records[s]) for s in SYSTEMS}
      pairs = list(zip(records["AR"][1:], records["SD"][1:]))
      step, rollout = (pair_ratio(pairs, p) for p in ("step", "rollout"))
      share = stats["AR"]["rollout_s"] / stats["AR"]["step_s"]
      for s in SYSTEMS:
        rows.append({**cell, "system": s, **stats[s], "step_speedup": step,
                     "rollout_speedup": rollout, "ar_rollout_share": share})
      summary[f"step_speedup_sd_vs_ar_n{N}_len{L}"] = step
      summary[f"rollout_speedup_sd_vs_ar_n{N}_len{L}"] = rollout
      print(f"  sweep N={N} L={L}: step {step:.2f}x, rollout {rollout:.2f}x,"
            f" AR rollout share {share:.2f}", flush=True)
  return rows, summary


def seed_mean(series: list[dict[str, tuple[list, list]]]) -> dict[str, tuple[list, list]]:
  """`held_out_accuracy` series of several seeds (evaluated at the same steps) as their
  mean over seeds."""
  return {name: (steps, list(np.nanmean([s[name][1] for s in series], axis=0)))
          for name, (steps, _) in series[0].items()}


def draw_system(axes, system: str, color: str, steps: list[dict],
                held_out: list[dict]) -> None:
  """One system's curves on ``axes`` (rows: reward, held-out accuracy if any; columns:
  against steps, against training seconds): the mean over seeds of the raw reward and
  its trailing mean, the band the seeds' trailing means span, the seeds' mean held-out
  accuracy."""
  seeds = sorted({r["seed"] for r in steps})
  runs = [sorted((r for r in steps if r["system"] == system and r["seed"] == seed),
                 key=lambda r: r["step"]) for seed in seeds]
  t = np.array([r["step"] for r in runs[0]])
  rewards = np.array([[r["reward_mean"] for r in run] for run in runs])
  # A step's seconds less its compiles: a short run's compiles (SD's take longer) would
  # otherwise dominate a clock that a long run pays them on once.
  seconds = np.mean([np.cumsum([learner_net_s(r) for r in run]) for run in runs], axis=0)
  window = trend_window(len(t))
  label = system if len(runs) == 1 else f"{system}, mean of {len(runs)} seeds"
  for ax, x in zip(axes[0], (t, seconds)):
    draw_trend(ax, t, rewards.mean(0), window, color, label, x=x)
    if len(runs) > 1:
      band = [moving_average(t, r, window) for r in rewards]
      ax.fill_between(x, np.min(band, 0), np.max(band, 0), color=color, alpha=0.15,
                      label=f"{system}: seeds' trailing means, min to max")
  if len(axes) > 1:
    series = seed_mean([held_out_accuracy([e for e in held_out if e["system"] == system
                                           and e["seed"] == seed]) for seed in seeds])
    clock = np.concatenate([[0.0], seconds])  # evaluation after step k: at clock[k]
    for ax, x in zip(axes[1], (None, lambda ks: clock[np.asarray(ks)])):
      draw_held_out(ax, series, color, f"{system}: ", x)


def plot_runs(path: str, steps: list[dict], held_out: list[dict],
              systems: tuple[str, ...] = SYSTEMS,
              title: str = "GRPO rollout reward, AR vs SD rollouts") -> str:
  """Part 1's figure: each system's reward (and held-out accuracy, when evaluated)
  against steps and against training seconds, where faster steps show; writes
  ``path``."""
  rows = 2 if held_out else 1
  fig = Figure(figsize=(12, 4.2 * rows))
  axes = fig.subplots(rows, 2, sharex="col", squeeze=False)
  for i, system in enumerate(systems):
    draw_system(axes, system, f"C{i}", steps, held_out)
  axes[0, 0].set_title(title)
  axes[0, 1].set_title("the same against training time")
  for ax in axes[0]:
    ax.set_ylabel("rollout reward (mean)")
  if held_out:
    axes[1, 0].set_title("held-out pass@1 (mean over seeds)", fontsize=10)
  axes[-1, 0].set_xlabel("step")
  axes[-1, 1].set_xlabel("training seconds (cumulative, XLA compiles taken out)")
  for ax in axes.flat:
    ax.grid(alpha=0.3)
  for ax in axes[:, 0]:  # the right column draws the same lines
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  return path


def plot_sweep(path: str, sweep_rows: list[dict]) -> str:
  """Part 2's figure: step and rollout speedup over rollout batch, one line per
  response length; writes ``path``."""
  fig = Figure(figsize=(10, 4))
  axes = fig.subplots(1, 2)
  sd_rows = [r for r in sweep_rows if r["system"] == "SD"]
  for L in sorted({r["L"] for r in sd_rows}):
    cells = sorted((r for r in sd_rows if r["L"] == L), key=lambda r: r["N"])
    for ax, key in zip(axes, ("step_speedup", "rollout_speedup")):
      ax.plot([r["N"] for r in cells], [r[key] for r in cells], "o-", label=f"L={L}")
  for ax, title in zip(axes, ("end-to-end step", "rollout")):
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("rollout batch N = prompts x group")
    ax.set_ylabel("speedup SD vs AR")
    ax.set_title(f"{title} speedup")
    ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  return path


def plan_from_args(args: argparse.Namespace) -> Plan:
  """`QUICK` or `FULL` with the fields given on the command line replaced."""
  ints = lambda text: tuple(int(x) for x in text.split(","))
  fields = {
      "seeds": args.seeds and ints(args.seeds),
      "steps": args.steps,
      "eval_n": args.eval_n,
      "eval_every": args.eval_every,
      "batches": args.batches and tuple(tuple(int(x) for x in cell.split("x"))
                                        for cell in args.batches.split(",")),
      "lengths": args.lengths and ints(args.lengths),
      "sweep_steps": args.sweep_steps,
  }
  return dataclasses.replace(QUICK if args.quick else FULL,
                             **{k: v for k, v in fields.items() if v is not None})


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--config", default=None, help="a recipe (default: the CPU default)")
  parser.add_argument("--mode", default=None,
                      help="compare RL modes instead (bench/rl_async.py), e.g. sync,async"
                      " or sync,async:1,async:2 (async: staleness 1; async:N: N)")
  parser.add_argument("--quick", action="store_true", help="fewer seeds, steps and cells")
  parser.add_argument("--out", default=None, help="the JSON (default: results/"
                      "bench_rl.json, with --mode results/bench_rl_modes.json)")
  parser.add_argument("--seeds", default=None, help="runs: seeds, e.g. 0,1,2")
  parser.add_argument("--steps", type=int, default=None, help="runs: steps per run")
  parser.add_argument("--eval-n", type=int, default=None,
                      help="runs: held-out prompts per source per evaluation (0: none)")
  parser.add_argument("--eval-every", type=int, default=None,
                      help="runs: steps between evaluations (0: only before and after)")
  parser.add_argument("--batches", default=None,
                      help="sweep: prompts x group cells, e.g. 2x8,8x8")
  parser.add_argument("--lengths", default=None, help="sweep: max_new_tokens, e.g. 32,96")
  parser.add_argument("--sweep-steps", type=int, default=None,
                      help="sweep: measured steps per system and cell")
  parser.add_argument("overrides", nargs="*", help="section.field=value for every run")
  args = parser.parse_args(argv)
  args.out = args.out or common.default_out("rl_modes" if args.mode else "rl")
  base = load_config(args.config, args.overrides)
  plan = plan_from_args(args)
  with tempfile.TemporaryDirectory() as tmp:
    # Trainers of equal shapes (every seed, every system's learner) compile once.
    jax.config.update("jax_compilation_cache_dir", os.path.join(tmp, "jax_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    if args.mode:
      from spec_rl_jax.bench import rl_async  # it builds on this module's helpers
      return rl_async.main(base, plan, args.mode, tmp, args.out, args.quick,
                           args.config or "default")
    run_rows, summary, curves, steps, held_out = run_seeds(base, plan, tmp)
    print(f"runs: {base.rollout.prompts_per_step}x{base.rollout.group_size} responses,"
          f" max_new_tokens {base.rollout.max_new_tokens}, seeds {list(plan.seeds)},"
          f" {plan.steps} steps")
    common.print_table(run_rows, ["seed", "system", "rollout_s", "reward_s", "update_s",
                                  "step_s", "first_step_s", "compiling_steps",
                                  "compile_s", "acceptance_length", "response_len", "reward_mean",
                                  "reward_final"])
    sweep_rows, sweep_summary = run_sweep(base, plan, tmp)
  summary.update(sweep_summary)
  step_cells = {k: v for k, v in sweep_summary.items() if k.startswith("step_")}
  best = max(step_cells, key=step_cells.get)
  summary["best_step_speedup_setting"], summary["best_step_speedup"] = best, step_cells[best]
  summary["proposer"] = base.drafter.proposer
  summary["num_draft_tokens"] = base.drafter.num_draft_tokens
  print("\nsweep (EOS ignored: every response has L tokens)")
  common.print_table(sweep_rows, ["case", "system", "rollout_s", "reward_s", "update_s",
                                  "step_s", "compiling_steps", "compile_s",
                                  "acceptance_length", "step_speedup", "rollout_speedup",
                                  "ar_rollout_share"])
  summary["recipe"] = args.config or "default"
  std = summary["final_reward_seed_std"]
  print(f"\nrecipe {summary['recipe']}: end-to-end step speedup SD/AR"
        f" {summary['step_speedup_sd_vs_ar_recipe']:.2f}x (rollout"
        f" {summary['rollout_speedup_sd_vs_ar_recipe']:.2f}x; per response token"
        f" {summary['step_speedup_per_token_sd_vs_ar_recipe']:.2f}x; AR rollout share"
        f" {summary['ar_rollout_share_recipe']:.2f}; compile seconds left in: step"
        f" {summary['step_speedup_sd_vs_ar_recipe_incl_compile']:.2f}x, rollout"
        f" {summary['rollout_speedup_sd_vs_ar_recipe_incl_compile']:.2f}x);"
        f" final reward SD - AR ="
        f" {summary['final_reward_diff_sd_minus_ar']:+.3f} vs seed std"
        f" {'n/a (one seed)' if std is None else f'{std:.3f}'}")
  result = common.write_results(args.out, "rl", args.quick, summary, run_rows + sweep_rows,
                                reward_curves=curves, steps=steps, held_out=held_out,
                                plan=dataclasses.asdict(plan))
  folder = pathlib.Path(args.out).parent
  for p in (plot_runs(str(folder / "rl_reward_curves.png"), steps, held_out),
            plot_sweep(str(folder / "rl_speedup.png"), sweep_rows)):
    print(f"wrote {p}")
  return result["summary"]


if __name__ == "__main__":
  main()
