"""RL step time with AR vs speculative rollouts: ``python -m spec_rl_jax.bench.rl``.

The same short GRPO run (the default recipe, no evaluation) twice — ``K = 0`` (AR) and
``K = drafter.num_draft_tokens`` with the recipe's proposer — reporting the median
step time split (rollout, reward, update; the first, compiling step excluded), the
end-to-end speedup, and both reward curves. SD is lossless, so the curves must agree
statistically: the table gives ``z = (mean_SD - mean_AR) / SE`` over per-step mean
rewards (|z| < 3 expected). Runs are sequential, AR first.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile

import numpy as np

from spec_rl_jax.bench import common
from spec_rl_jax.config import load_config
from spec_rl_jax.rl.metrics import read_metrics
from spec_rl_jax.sft import use_fast_cpu_flags
from spec_rl_jax.train import Trainer

PHASES = ("rollout", "reward", "update", "step")


def run_one(cfg) -> list[dict]:
  trainer = Trainer(cfg)
  try:
    trainer.run()
  finally:
    trainer.close()
  return read_metrics(cfg.run_dir)


def summarize(name: str, K: int, records: list[dict]) -> dict:
  warm = records[1:]
  row = {"system": name, "K": K, "steps": len(records),
         **{f"{p}_s": float(np.median([r[f"time/{p}_s"] for r in warm])) for p in PHASES},
         "acceptance_length": float(np.mean([r["spec/acceptance_length"] for r in warm])),
         "reward_mean": float(np.mean([r["rollout/reward_mean"] for r in records]))}
  return row


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--config", default=None)
  parser.add_argument("--quick", action="store_true", help="6 steps instead of 20")
  parser.add_argument("--out", default=common.default_out("rl"))
  parser.add_argument("overrides", nargs="*")
  args = parser.parse_args(argv)
  use_fast_cpu_flags()
  base = load_config(args.config, args.overrides)
  steps = 6 if args.quick else 20
  K = base.drafter.num_draft_tokens
  rows, curves = [], {}
  with tempfile.TemporaryDirectory() as tmp:
    for name, k in (("AR", 0), ("SD", K)):
      cfg = dataclasses.replace(
          base, run_dir=f"{tmp}/{name}", steps=steps, progress=False,
          data=dataclasses.replace(base.data, eval_n=0),
          drafter=dataclasses.replace(base.drafter, num_draft_tokens=k))
      records = run_one(cfg)
      rows.append(summarize(name, k, records))
      curves[name] = [r["rollout/reward_mean"] for r in records]
  a, b = np.asarray(curves["AR"]), np.asarray(curves["SD"])
  se = np.sqrt(a.var(ddof=1) / len(a) + b.var(ddof=1) / len(b))
  summary = {"speedup_step": rows[0]["step_s"] / rows[1]["step_s"],
             "speedup_rollout": rows[0]["rollout_s"] / rows[1]["rollout_s"],
             "reward_z": float((b.mean() - a.mean()) / se) if se > 0 else 0.0,
             "proposer": base.drafter.proposer}
  common.print_table(rows, ["system", "K", "steps", "rollout_s", "reward_s", "update_s",
                            "step_s", "acceptance_length", "reward_mean"])
  print(f"end-to-end step speedup {summary['speedup_step']:.2f}x, rollout speedup"
        f" {summary['speedup_rollout']:.2f}x, reward curves z = {summary['reward_z']:.2f}")
  common.write_results(args.out, "rl", args.quick, summary, rows, reward_curves=curves)
  return summary


if __name__ == "__main__":
  main()
