"""``python -m spec_rl_jax.sim``: projected RL step times, AR vs SD, sync vs async.

  python -m spec_rl_jax.sim --model qwen3-8b --hardware tpu-v5p-64 --drafter eagle3 \\
      --num-draft-tokens auto --mode sync,async [--acceptance FILE | --from-run RUN_DIR]

For each system (AR; SD with the drafter) and mode it prints the step's breakdown
(prefill, verification and drafting rounds, learner, weight transfer, idle) and
writes JSON (``--out``) plus a PNG next to it: stacked bars per configuration, and the
SD speedup vs model size (the Qwen3 family on the same hardware and workload).

Inputs not given take documented defaults (`DEFAULT_ACCEPTANCE`, the workload flags).
``--from-run`` reads a training run directory (``config.yaml`` and ``metrics.jsonl``):
its per-position acceptance (``spec/acceptance_at``), mean response lengths per step,
prompts x group, max lengths, reward seconds and learner micro-batch.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import numpy as np
import yaml

from spec_rl_jax.sim import acceptance as acc
from spec_rl_jax.sim import report
from spec_rl_jax.sim.hardware import get_pod
from spec_rl_jax.sim.models import MODELS, get_drafter, get_model
from spec_rl_jax.sim.pipeline import Workload, make_plan, simulate_steps

# a_0 of a geometric acceptance when none is given: Eagle3 ~ the NeMo-RL paper's
# acceptance length 2.47 at k = 3 (α ≈ 0.68); a draft model: `AdaptiveK`'s prior (0.6);
# MTP as Eagle3; n-gram matching on reasoning text, lower.
DEFAULT_ACCEPTANCE = {"eagle3": 0.68, "mtp": 0.68, "draft_model": 0.6, "ngram": 0.4}
ASYNC_FRACTIONS = (0.25, 0.375, 0.5, 0.625, 0.75)  # rollout share of chips tried (async)


@dataclasses.dataclass(frozen=True)
class Scenario:
  """Everything one projection needs (the CLI's flags, resolved)."""

  model: str
  hardware: str
  drafter: str
  draft_model: str | None
  k: int | None  # None: auto
  max_draft_tokens: int
  acceptance: tuple
  workload: Workload
  tp: int | None
  slots: int | None
  staleness: int
  rollout_chips: int | None
  machine_json: str | None = None


def run_dir_inputs(path: str) -> dict:
  """What a training run directory says about its workload and acceptance."""
  with open(os.path.join(path, "config.yaml")) as f:
    cfg = yaml.safe_load(f)
  with open(os.path.join(path, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f if line.strip()][1:]  # step 1 compiles
  if not rows:
    raise ValueError(f"{path}/metrics.jsonl has no step after the first")
  r, lr = cfg["rollout"], cfg["learner"]
  at = [x["spec/acceptance_at"] for x in rows if x.get("spec/acceptance_at")]
  return {"acceptance": tuple(np.mean(at, axis=0)) if at else None,
          "mean_lens": [x["rollout/response_len"] for x in rows],
          "prompts": r["prompts_per_step"], "group": r["group_size"],
          "max_len": r["max_new_tokens"], "prompt_len": r["max_prompt_len"],
          "slots": r["num_slots"], "micro_batch": lr["micro_batch_size"],
          "reward_s": float(np.median([x["time/reward_s"] for x in rows])),
          "drafter": cfg["drafter"]["proposer"], "k": cfg["drafter"]["num_draft_tokens"]}


def project(sc: Scenario, modes=("sync", "async"), with_ar: bool = True) -> dict:
  """Step results ``{"AR"/"SD": {mode: (Plan, StepResult)}}`` for one scenario; the
  rollout mesh (``tp``) is the fastest valid one for synchronous AR unless given, and
  async's rollout share of the chips the fastest of `ASYNC_FRACTIONS` unless given."""
  pod = get_pod(sc.hardware, sc.machine_json)
  model = get_model(sc.model)
  drafter = get_drafter(sc.drafter, model, sc.draft_model)
  none = get_drafter("none", model)
  a = acc.extend(np.asarray(sc.acceptance), sc.max_draft_tokens)
  w = sc.workload
  systems = {"AR": (none, np.zeros(0), 0)} if with_ar else {}
  systems["SD"] = (drafter, a, sc.k)

  def run(d, a_, k, tp, rollout_chips, steps=None):
    plan = make_plan(pod, model, d, w, tp, rollout_chips, sc.slots)
    w_ = dataclasses.replace(w, steps=steps) if steps else w
    return plan, simulate_steps(pod, model, d, a_, k, w_, plan, sc.staleness)

  tp = sc.tp or _best_tp(pod, model, drafter, w, sc.slots, run)
  out = {}
  for name, (d, a_, k) in systems.items():
    out[name] = {}
    for mode in modes:
      if mode == "sync":
        out[name][mode] = run(d, a_, k, tp, None)
      elif sc.rollout_chips is not None:
        out[name][mode] = run(d, a_, k, tp, sc.rollout_chips)
      else:
        options = sorted({max(tp, round(f * pod.chips / tp) * tp) for f in ASYNC_FRACTIONS}
                         - {pod.chips})
        tried = [_try(run, d, a_, k, tp, rc) for rc in options]
        tried = [t for t in tried if t is not None]
        if not tried:
          raise ValueError(f"no split of {pod.chips} chips of {pod.name} into a rollout"
                           f" pool (multiples of tp={tp}) and a learner pool fits {model.name}")
        out[name][mode] = min(tried, key=lambda t: t[1].step)
  return out


def _try(run, *args):
  try:
    return run(*args)
  except ValueError:
    return None


def _best_tp(pod, model, drafter, w, slots, run) -> int:
  """The TP (a power of two dividing the chips) whose synchronous AR step is fastest,
  among those that divide the model and fit; when none fits, the largest valid one's
  memory error."""
  cands = [t for t in (1, 2, 4, 8, 16, 32, 64) if t <= pod.chips and pod.chips % t == 0]
  results, last_error = [], None
  none = get_drafter("none", model)
  for t in cands:
    try:
      make_plan(pod, model, drafter, w, t, None, slots)  # the SD drafter must fit too
      results.append((run(none, np.zeros(0), 0, t, None, steps=2)[1].step, t))
    except ValueError as e:
      last_error = e
  if not results:
    raise last_error
  return min(results)[1]


def size_sweep(sc: Scenario) -> list[dict]:
  """SD speedup (step, sync and async) vs model size: the Qwen3 models that fit the
  hardware, same workload and acceptance."""
  rows = []
  w = dataclasses.replace(sc.workload, steps=sc.staleness + 2)
  for name in MODELS:
    print(f"  size sweep: {name}", flush=True)
    try:
      res = project(dataclasses.replace(sc, model=name, tp=None, slots=None, workload=w,
                                        rollout_chips=None, draft_model=None))
    except ValueError as e:
      print(f"    skipped: {e}")
      continue
    ar = res["AR"]["sync"][1].step
    rows.append({"model": name, "params_b": get_model(name).total_params / 1e9,
                 **{f"speedup_{m}": ar / res["SD"][m][1].step for m in res["SD"]}})
  return rows


def parse_args(argv=None) -> argparse.Namespace:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--model", default="qwen3-8b")
  ap.add_argument("--hardware", default="tpu-v5p-64")
  ap.add_argument("--drafter", default="eagle3")
  ap.add_argument("--draft-model", default=None, help="for --drafter draft_model")
  ap.add_argument("--num-draft-tokens", default="auto", help="auto or an integer k")
  ap.add_argument("--max-draft-tokens", type=int, default=4, help="K for auto")
  ap.add_argument("--mode", default="sync,async")
  src = ap.add_mutually_exclusive_group()
  src.add_argument("--acceptance", default=None,
                   help="JSON: per-position a_i = P(drafts 0..i accepted)")
  src.add_argument("--acceptance-rate", type=float, default=None,
                   help="geometric acceptance a_i = rate^(i+1)")
  src.add_argument("--acceptance-length", type=float, default=None,
                   help="a reported acceptance length at --num-draft-tokens (geometric)")
  ap.add_argument("--from-run", default=None, help="a training run directory")
  ap.add_argument("--prompts", type=int, default=256)
  ap.add_argument("--group", type=int, default=16)
  ap.add_argument("--prompt-len", type=int, default=512)
  ap.add_argument("--mean-len", type=float, default=4096)
  ap.add_argument("--max-len", type=int, default=16384)
  ap.add_argument("--len-sigma", type=float, default=0.8, help="lognormal shape")
  ap.add_argument("--mfu", type=float, default=0.4, help="learner model FLOP utilisation")
  ap.add_argument("--extra-forwards", type=int, default=0,
                  help="learner forward passes beyond one forward+backward")
  ap.add_argument("--micro-batch", type=int, default=0,
                  help="learner micro-batch (padded as rl.learner pads; 0: packed)")
  ap.add_argument("--reward-s", type=float, default=0.0)
  ap.add_argument("--tp", type=int, default=None, help="chips per rollout replica")
  ap.add_argument("--slots", type=int, default=None, help="slots per replica")
  ap.add_argument("--staleness", type=int, default=1)
  ap.add_argument("--rollout-chips", type=int, default=None, help="async rollout pool")
  ap.add_argument("--steps", type=int, default=4)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--machine-json", default=None, help="this-machine: a bench.rollout JSON")
  ap.add_argument("--out", default="results/sim.json")
  ap.add_argument("--no-plot", action="store_true")
  ap.add_argument("--no-sweep", action="store_true", help="skip speedup vs model size")
  return ap.parse_args(argv)


def scenario_from_args(args: argparse.Namespace) -> Scenario:
  k = None if args.num_draft_tokens == "auto" else int(args.num_draft_tokens)
  K = args.max_draft_tokens if k is None else max(k, 1)
  w = dict(prompts=args.prompts, group=args.group, prompt_len=args.prompt_len,
           mean_len=args.mean_len, max_len=args.max_len, len_sigma=args.len_sigma,
           mfu=args.mfu, extra_forwards=args.extra_forwards, micro_batch=args.micro_batch,
           reward_s=args.reward_s, steps=args.steps, seed=args.seed)
  a, drafter, slots = None, args.drafter, args.slots
  if args.from_run:
    run = run_dir_inputs(args.from_run)
    w.update(prompts=run["prompts"], group=run["group"], max_len=run["max_len"],
             prompt_len=run["prompt_len"], micro_batch=run["micro_batch"],
             reward_s=run["reward_s"], mean_len=float(np.mean(run["mean_lens"])),
             steps=max(args.steps, len(run["mean_lens"])))
    a, slots = run["acceptance"], slots or run["slots"]
  if args.acceptance:
    a = acc.load(args.acceptance)
  elif args.acceptance_rate is not None:
    a = acc.geometric(args.acceptance_rate, K)
  elif args.acceptance_length is not None:
    a = acc.geometric(acc.alpha_for_length(args.acceptance_length, K), K)
  if a is None:
    if drafter not in DEFAULT_ACCEPTANCE:
      get_drafter(drafter, get_model(args.model))  # unknown name: lists the known ones
      raise ValueError(f"drafter {drafter!r} drafts nothing: pass --drafter")
    a = acc.geometric(DEFAULT_ACCEPTANCE[drafter], K)
  return Scenario(args.model, args.hardware, drafter, args.draft_model, k, K,
                  tuple(acc.validate(a)), Workload(**w), args.tp, slots, args.staleness,
                  args.rollout_chips, args.machine_json)


def main(argv=None) -> dict:
  args = parse_args(argv)
  sc = scenario_from_args(args)
  modes = tuple(m for m in args.mode.split(",") if m)
  bad = set(modes) - {"sync", "async"}
  if bad:
    raise SystemExit(f"unknown mode(s) {sorted(bad)}; known: sync, async")
  print(f"simulating {sc.model} on {sc.hardware}, drafter {sc.drafter},"
        f" k={'auto' if sc.k is None else sc.k}, modes {','.join(modes)} ...", flush=True)
  res = project(sc, modes)
  sweep = [] if args.no_sweep else size_sweep(dataclasses.replace(sc, model=sc.model))
  return report.write(args.out, sc, res, sweep, plot=not args.no_plot)
