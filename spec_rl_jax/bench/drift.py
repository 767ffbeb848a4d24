"""Drafter staleness during RL: ``python -m spec_rl_jax.bench.drift``.

As RL moves the policy, a frozen drafter's proposals fit it less and the acceptance
length ``τ`` (tokens per speculative round) falls, and with it the speedup. This runs,
per seed, four trainers from the same (config, seed), their steps interleaved (machine
noise hits all alike):

  AR              plain rollouts (``K = 0``): the reward curve speculation must keep;
  frozen          speculative rollouts, the drafter as the SFT left it;
  online-uniform  the drafter distilled from the policy every step (token mean);
  online-reward   likewise, weighted towards high-reward responses (ReSpec).

The setting is the drift one (`DRIFT`): the default recipe (multiplication) at a
learning rate high enough for the policy to move within the run, and a fixed draft
length so ``τ`` measures the drafter alone (an adaptive ``k`` would shorten rounds as
acceptance falls). Reported per arm: ``τ`` per step (mean over seeds; PNG), ``τ`` at the
end over ``τ`` at the start (means of the first and last `WINDOW` steps), the rollout
throughput over AR's at the end (response tokens/s, per seed paired), the update's time
over the frozen arm's (the drafter's extra forward and backward; compile seconds out),
and the final reward (mean of the last third of steps) next to AR's with the
seed-to-seed spread: losslessness means the curves agree within it.

``--quick``: one seed, a few steps (the plumbing, not the figures). Extra arguments
are dotted config overrides applied to every arm (e.g. ``learner.lr=1e-4``).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile

import numpy as np
from tqdm import tqdm

from spec_rl_jax.bench import common
from spec_rl_jax.bench.rl import interleave, net_s
from spec_rl_jax.config import TrainConfig, load_config
from spec_rl_jax.train import Trainer

WINDOW = 5  # steps averaged for the start and end of a curve
ARMS = {  # name: (draft length, drafter.train.every, weighting)
    "AR": (0, 0, "uniform"),
    "frozen": (None, 0, "uniform"),
    "online-uniform": (None, 1, "uniform"),
    "online-reward": (None, 1, "reward"),
}
DRIFT = ("data.sources=[task:multiplication]", "learner.lr=3e-4", "drafter.num_draft_tokens=4",
         "rollout.prompts_per_step=8", "data.eval_n=0", "checkpoint.every=1000")


@dataclasses.dataclass(frozen=True)
class Plan:
  seeds: tuple[int, ...]
  steps: int


FULL = Plan(seeds=(0, 1, 2), steps=40)
QUICK = Plan(seeds=(0,), steps=4)


def arm_config(base: TrainConfig, arm: str, run_dir: str, seed: int) -> TrainConfig:
  K, every, weighting = ARMS[arm]
  d = base.drafter
  return dataclasses.replace(
      base, run_dir=run_dir, progress=False,
      drafter=dataclasses.replace(
          d, num_draft_tokens=d.num_draft_tokens if K is None else K,
          train=dataclasses.replace(d.train, every=every, weighting=weighting)),
      rollout=dataclasses.replace(base.rollout, seed=seed),
      data=dataclasses.replace(base.data, seed=seed))


def _mean(xs) -> float:
  return float(np.mean(list(xs)))


def summarise(records: dict[str, list[list[dict]]]) -> tuple[dict, list[dict]]:
  """``records[arm][seed][step]`` → (summary ratios, one row per arm)."""
  first = lambda rs, key: _mean(r[key] for r in rs[:WINDOW])  # noqa: E731
  last = lambda rs, key: _mean(r[key] for r in rs[-WINDOW:])  # noqa: E731
  third = lambda rs: _mean(r["rollout/reward_mean"] for r in rs[-max(len(rs) // 3, 1):])  # noqa: E731
  ar_final = [third(rs) for rs in records["AR"]]
  rows, summary = [], {}
  for arm, runs in records.items():
    finals = [third(rs) for rs in runs]
    row = {"arm": arm, "final_reward": _mean(finals),
           "final_reward_seed_std": float(np.std(finals)),
           "final_reward_minus_ar": _mean(finals) - _mean(ar_final)}
    if arm != "AR":
      row.update(
          tau_start=_mean(first(rs, "spec/acceptance_length") for rs in runs),
          tau_end=_mean(last(rs, "spec/acceptance_length") for rs in runs),
          tau_end_over_start=_mean(last(rs, "spec/acceptance_length")
                                   / first(rs, "spec/acceptance_length") for rs in runs),
          rollout_speedup_vs_ar_end=statistics.median(
              last(rs, "rollout/tokens_per_s") / last(ar, "rollout/tokens_per_s")
              for rs, ar in zip(runs, records["AR"])),
          update_time_vs_frozen=statistics.median(
              net_s(r, "update") / net_s(f, "update")
              for rs, fs in zip(runs, records["frozen"]) for r, f in zip(rs[1:], fs[1:])))
      if "train/draft_acceptance" in runs[0][-1]:
        row["draft_acceptance_end"] = _mean(last(rs, "train/draft_acceptance") for rs in runs)
      key = arm.replace("-", "_")
      summary[f"{key}_tau_end_over_start"] = row["tau_end_over_start"]
      summary[f"{key}_rollout_speedup_vs_ar_end"] = row["rollout_speedup_vs_ar_end"]
      if arm.startswith("online"):
        summary[f"{key}_update_time_vs_frozen"] = row["update_time_vs_frozen"]
    summary[f"{arm.replace('-', '_')}_final_reward_minus_ar"] = row["final_reward_minus_ar"]
    rows.append(row)
  summary["ar_final_reward_seed_std"] = float(np.std(ar_final))
  return summary, rows


def plot(records: dict[str, list[list[dict]]], out: str) -> str:
  from matplotlib.figure import Figure
  fig = Figure(figsize=(11, 4))
  ax_tau, ax_reward = fig.subplots(1, 2)
  for arm, runs in records.items():
    steps = np.arange(1, len(runs[0]) + 1)
    reward = np.mean([[r["rollout/reward_mean"] for r in rs] for rs in runs], 0)
    ax_reward.plot(steps, reward, label=arm)
    if arm != "AR":
      tau = np.mean([[r["spec/acceptance_length"] for r in rs] for rs in runs], 0)
      ax_tau.plot(steps, tau, label=arm)
  ax_tau.set(xlabel="RL step", ylabel="acceptance length τ (tokens / round)",
             title="drafter staleness (mean over seeds)")
  ax_reward.set(xlabel="RL step", ylabel="reward (mean over seeds)", title="reward")
  for ax in (ax_tau, ax_reward):
    ax.legend()
    ax.grid(alpha=0.3)
  fig.tight_layout()
  return common.save_plot(fig, out)


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--out", default=common.default_out("drift"))
  parser.add_argument("--config", default=None, help="a recipe (default: the CPU default)")
  parser.add_argument("--seeds", type=int, nargs="+", default=None)
  parser.add_argument("--steps", type=int, default=None)
  parser.add_argument("overrides", nargs="*", help="section.field=value (every arm)")
  args = parser.parse_args(argv)
  plan = QUICK if args.quick else FULL
  plan = dataclasses.replace(plan, **{k: v for k, v in (
      ("seeds", tuple(args.seeds) if args.seeds else None), ("steps", args.steps))
      if v is not None})
  overrides = [*DRIFT, *(["rollout.prompts_per_step=2", "rollout.group_size=4",
                          "learner.micro_batch_size=8"] if args.quick else []),
               *args.overrides]
  base = dataclasses.replace(load_config(args.config, overrides), steps=plan.steps)
  records = {arm: [] for arm in ARMS}
  bar = tqdm(total=len(plan.seeds) * plan.steps * len(ARMS), desc="trainer steps")
  with tempfile.TemporaryDirectory() as tmp:
    for seed in plan.seeds:
      trainers = {arm: Trainer(arm_config(base, arm, f"{tmp}/{arm}{seed}", seed))
                  for arm in ARMS}
      try:
        for arm, recs in interleave(trainers, plan.steps, bar).items():
          records[arm].append(recs)
      finally:
        for trainer in trainers.values():
          trainer.close()
      last = {arm: records[arm][-1][-1] for arm in ARMS}
      tqdm.write(f"seed {seed}: τ at the last step " + ", ".join(
          f"{arm} {r['spec/acceptance_length']:.2f}" for arm, r in last.items() if arm != "AR"))
  bar.close()
  summary, rows = summarise(records)
  common.print_table(rows, ["arm", "tau_start", "tau_end", "tau_end_over_start",
                            "rollout_speedup_vs_ar_end", "update_time_vs_frozen",
                            "draft_acceptance_end", "final_reward", "final_reward_seed_std",
                            "final_reward_minus_ar"])
  keep = ("spec/acceptance_length", "rollout/reward_mean", "rollout/tokens_per_s",
          "rollout/response_len", "time/update_s", "time/update_compile_s",
          "time/rollout_s", "train/draft_loss", "train/draft_acceptance",
          "spec/draft_lag_steps")
  steps = {arm: [[{k: r[k] for k in keep if k in r} for r in rs] for rs in runs]
           for arm, runs in records.items()}
  png = plot(records, args.out)
  return common.write_results(args.out, "drift", args.quick, summary, rows,
                              plan=dataclasses.asdict(plan), overrides=overrides,
                              steps=steps, plot=png)


if __name__ == "__main__":
  main()
