"""Records the calibration fixture of the simulator (calibration (a)):
``python -m spec_rl_jax.sim.record [--steps 8] [--out tests/data/sim_cpu_run.json]
[section.field=value ...]``.

One AR and one SD trainer (the CPU default recipe, the draft model at a fixed ``K``,
``--k``, 3 by default) built from the same config and seed take their steps interleaved
in one process (`bench.rl.interleave`'s order: AR SD, SD AR, ...; machine noise hits
both alike); after every pair, `overhead.Probe` samples this machine's figures (matmul
FLOP/s, read bandwidth, rounds for ``τ`` and ``λ``) under the load the run sees, and
the fixture keeps their medians (``machine``); with them, `overhead.LearnerProbe` times
one forward + backward of a training micro-batch of the run's shapes through the AR
run's own learner (``learner_GFLOPs``: the rate calibration (a) predicts the update
from). Kept per step: the phase seconds and their XLA compile seconds, the mean
response length and the engine's per-position acceptance (``spec/acceptance_at``), and
every response's length (the simulator replays them instead of a fitted distribution).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile

from spec_rl_jax.sim.calibrate import FIXTURE

KEEP = {"rollout_s": "time/rollout_s", "rollout_decode_s": "time/rollout_decode_s",
        "rollout_compile_s": "time/rollout_compile_s", "reward_s": "time/reward_s",
        "update_s": "time/update_s", "update_compile_s": "time/update_compile_s",
        "response_len": "rollout/response_len", "acceptance_length": "spec/acceptance_length",
        "acceptance_at": "spec/acceptance_at"}


def _commit() -> str:
  try:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return "unknown"


def record(steps: int, K: int, overrides: list[str]) -> dict:
  import jax
  from tqdm import tqdm
  from spec_rl_jax.bench.rl import variant
  from spec_rl_jax.config import load_config
  from spec_rl_jax.sim.overhead import LearnerProbe, Probe, summarize
  from spec_rl_jax.train import Trainer

  base = load_config(None, ["checkpoint.every=1000", *overrides])
  lengths = {"AR": [], "SD": []}
  with tempfile.TemporaryDirectory() as tmp:
    jax.config.update("jax_compilation_cache_dir", os.path.join(tmp, "jax_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    trainers = {s: Trainer(variant(base, f"{tmp}/{s}", k, base.rollout.seed))
                for s, k in (("AR", 0), ("SD", K))}
    for name, tr in trainers.items():  # every response's length, per step
      gen = tr.engine.generate

      def generate(requests, _gen=gen, _name=name):
        result = _gen(requests)
        lengths[_name].append([len(r.tokens) for r in result.responses])
        return result
      tr.engine.generate = generate
    learner, batches = trainers["AR"].learner, []  # the AR run's packed batches
    update = learner.update

    def capture(batch, *args, _update=update, **kw):
      batches[:] = [batch]
      return _update(batch, *args, **kw)
    learner.update = capture
    probe, learner_probe, samples = Probe(), None, []
    records = {name: [] for name in trainers}
    try:  # bench.rl.interleave's order (AR SD, SD AR, ...), a probe after every pair
      for t in range(steps):
        for name in (list(trainers) if t % 2 == 0 else list(trainers)[::-1]):
          records[name].append(trainers[name].train_step(tqdm(disable=True)))
        if learner_probe is None:  # a micro-batch of the first step's shapes
          learner_probe = LearnerProbe(learner, batches[0])
        samples.append({**probe.sample(), **learner_probe.sample(),
                        "load1": os.getloadavg()[0]})  # the machine's 1-minute load
        print(f"step {t + 1}/{steps}: learner"
              f" {samples[-1]['learner_GFLOPs']:.0f} GFLOP/s, matmul"
              f" {samples[-1]['matmul_GFLOPs']:.0f} GFLOP/s, load"
              f" {samples[-1]['load1']:.1f}", flush=True)
    finally:
      for tr in trainers.values():
        tr.close()
  machine = summarize(samples[1:])  # the first pair compiles: its probe too is apart
  r = base.rollout
  return {
      "source": (f"python -m spec_rl_jax.sim.record --steps {steps} --k {K}"
                 f" {' '.join(overrides)}".rstrip()
                 + f" (AR and SD trainers interleaved in one process, bench.rl.interleave;"
                 f" default recipe, default policy and draft model; code at {_commit()})"),
      "config": {"prompts_per_step": r.prompts_per_step, "group_size": r.group_size,
                 "max_prompt_len": r.max_prompt_len, "max_new_tokens": r.max_new_tokens,
                 "num_slots": r.num_slots, "micro_batch_size": base.learner.micro_batch_size,
                 "extra_forwards": learner_probe.extra_forwards,
                 "policy": "default-policy", "draft": "default-draft"},
      "machine": {"figures": machine["figures"], "rounds": machine["rounds"],
                  "fit_intercept_ms": machine["fit_intercept_ms"],
                  "fit_slope_ms": machine["fit_slope_ms"], "samples": samples},
      "runs": {s: {"num_draft_tokens": k,
                   "steps": [{**{f: rec[key] for f, key in KEEP.items()},
                              "lengths": lens}
                             for rec, lens in zip(records[s], lengths[s])]}
               for s, k in (("AR", 0), ("SD", K))},
  }


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--steps", type=int, default=8, help="steps per trainer (first compiles)")
  ap.add_argument("--k", type=int, default=3, help="the SD trainer's fixed draft length")
  ap.add_argument("--out", default=os.path.normpath(FIXTURE))
  ap.add_argument("overrides", nargs="*", help="section.field=value for both trainers")
  args = ap.parse_args(argv)
  fx = record(args.steps, args.k, args.overrides)
  text = json.dumps(fx, indent=1)  # lists of numbers on one line each
  text = re.sub(r"\[\s+([-\d.e,\s]+?)\s+\]", lambda m: "[" + " ".join(m.group(1).split()) + "]",
                text)
  with open(args.out, "w") as f:
    f.write(text + "\n")
  print(f"wrote {args.out}")
  return fx


if __name__ == "__main__":
  main()
