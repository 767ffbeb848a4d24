"""This machine's fixed cost per forward: ``python -m spec_rl_jax.sim.overhead [--out PATH]``.

On 2 CPU cores a forward of the default models (7.5M and 1.4M parameters) at a few
slots might not be bound by FLOPs or bytes: every XLA op has a fixed cost (dispatch, a
thunk, a small loop), and a decoder layer is a few dozen ops. That cost is measured
here, on the models the simulator calibrates against:

  for each shape (``default-policy``, ``default-draft``) and ``L`` in `LAYERS`: the
  decoder of that shape with ``L`` layers (random init) decodes ``NEW`` tokens greedily
  at ``B`` = 1 slot in the rollout engine (one device call, `NEW` rounds, after a
  compiling warm-up); a round's seconds ``t = decode_s / rounds`` (median over
  interleaved repetitions). Less the roofline of the same forward (`cost.forward_cost`
  with no latency terms), what is left is fitted by least squares over both shapes:

      t − roofline = τ + λ·L

  ``λ`` (``layer_latency_ms``): the fixed seconds of one layer of one forward;
  ``τ`` (``call_latency_ms``): the rest of a round (embedding, LM head, sampling, the
  round's bookkeeping); each clipped at 0. The simulator charges every forward ``τ + λ·L`` on this machine
  (`hardware.Chip.layer_latency`); accelerators keep their launch-latency assumption.

The JSON (``rows`` with ``metric``/``value``, as `bench.rollout` writes) can be passed to
the simulator as ``--machine-json``.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import statistics

import numpy as np

LAYERS = (1, 2, 4, 8)
SHAPES = ("default-policy", "default-draft")
PROMPT, NEW = 16, 32  # the CPU default's prompt and about its response length
FULL_SLOTS = 64  # the CPU default's slots: a diagnostic round at the real batch


def _engine(preset: str, layers: int | None, slots: int = 1):
  from spec_rl_jax.models.config import get_preset
  from spec_rl_jax.models.transformer import init_decoder
  from spec_rl_jax.rollout.engine import RolloutEngine
  from spec_rl_jax.rollout.types import EngineConfig
  from spec_rl_jax.sampling import SamplingParams
  cfg = get_preset(preset)
  cfg = dataclasses.replace(cfg, num_layers=layers or cfg.num_layers)
  seq = -(-(PROMPT + NEW) // 16) * 16
  return cfg, RolloutEngine(init_decoder(cfg, seed=0), EngineConfig(
      num_slots=slots, page_size=16, num_pages=slots * seq // 16, max_seq_len=seq,
      max_new_tokens=NEW, round_budget=NEW, min_prefill_len=PROMPT,
      sampling=SamplingParams(temperature=0.0)))


def roofline_s(preset: str, layers: int, chip, slots: int = 1) -> float:
  """The roofline seconds of one measured round (``slots`` tokens at the mean context)
  on ``chip``'s rates, without ``τ`` and ``λ``."""
  from spec_rl_jax.sim.cost import forward_cost
  from spec_rl_jax.sim.hardware import Pod
  from spec_rl_jax.sim.models import get_model
  chip = dataclasses.replace(chip, call_latency=0.0, layer_latency=0.0)
  model = dataclasses.replace(get_model(preset), layers=layers)
  ctx = slots * (PROMPT + NEW / 2)
  return float(forward_cost(model, Pod("this-machine", chip, 1), 1, slots, ctx, ctx).total)


def fit(points: list[tuple[int, float]]) -> tuple[float, float]:
  """Least squares ``y = τ + λ·L`` over ``(L, y)``; returns ``(τ, λ)``."""
  L = np.asarray([p[0] for p in points], float)
  y = np.asarray([p[1] for p in points], float)
  lam, tau = np.polyfit(L, y, 1)
  return float(tau), float(lam)


class Probe:
  """This machine's figures, sampled as often as asked (e.g. between a run's steps, so
  they see the load the run saw): ``matmul_GFLOPs`` (a jitted fp32 1024³ matmul),
  ``read_bandwidth_GBps`` (a jitted sum over 256 MiB), and the seconds of a round at
  1 slot of each (shape, ``L``) in `SHAPES` x `LAYERS` and at `FULL_SLOTS` slots of
  each shape as it is (medians over ``reps`` per sample)."""

  def __init__(self, reps: int = 3):
    import jax
    import jax.numpy as jnp
    self.reps = reps
    self.engines = {(p, L, 1): _engine(p, L) for p in SHAPES for L in LAYERS}
    self.engines.update({(p, None, FULL_SLOTS): _engine(p, None, FULL_SLOTS) for p in SHAPES})
    rng = np.random.default_rng(0)
    self.prompts = {key: rng.integers(1, cfg.vocab_size, (key[2], PROMPT)).tolist()
                    for key, (cfg, _) in self.engines.items()}
    self._rid = iter(range(10**9))
    self._a = jnp.ones((1024, 1024), jnp.float32)
    self._x = jnp.ones((64 * 1024**2,), jnp.float32)
    self._mm = jax.jit(lambda a: a @ a)
    self._sum = jax.jit(jnp.sum)
    self.sample()  # compiles

  def _round_s(self, key) -> float:
    from spec_rl_jax.rollout.types import Request
    eng = self.engines[key][1]
    s0, r0 = eng.stats["decode_s"], eng.stats["rounds"]
    eng.generate([Request(p, next(self._rid)) for p in self.prompts[key]])
    return (eng.stats["decode_s"] - s0) / max(eng.stats["rounds"] - r0, 1)

  def _timed(self, fn, arg) -> float:
    import time
    ts = []
    for _ in range(self.reps):
      t = time.perf_counter()
      fn(arg).block_until_ready()
      ts.append(time.perf_counter() - t)
    return statistics.median(ts)

  def sample(self) -> dict:
    out = {"matmul_GFLOPs": 2 * 1024**3 / self._timed(self._mm, self._a) / 1e9,
           "read_bandwidth_GBps": self._x.nbytes / self._timed(self._sum, self._x) / 1e9}
    rounds = {}
    for key in self.engines:
      rounds[key] = statistics.median(self._round_s(key) for _ in range(self.reps))
    out["rounds_ms"] = [{"shape": p, "layers": L, "slots": b, "round_ms": 1e3 * t}
                        for (p, L, b), t in rounds.items()]
    return out


class LearnerProbe:
  """The learner's achieved rate, sampled as often as asked (`sim.record`: between a
  run's steps, under the load its updates see): one forward + backward of one training
  micro-batch through the run's own `rl.learner.Learner` (`Learner.gradients`: its jitted
  accumulation, the same program family as the update's, at the current parameters; the
  state is not changed), on a micro-batch cut from a batch the run packed (``batch``:
  `rl.learner.pack_rollouts`, as given to `Learner.update`). ``learner_GFLOPs`` = the
  micro-batch's model FLOPs (`cost.learner_flops` over its ``m`` rows of its padded
  width ``T_b``, with one extra forward when the learner holds a frozen reference) over
  its median seconds (``reps`` timings, after a compiling warm-up)."""

  def __init__(self, learner, batch: dict, reps: int = 3):
    from spec_rl_jax.sim.cost import learner_flops
    from spec_rl_jax.sim.models import from_config
    self.learner, self.reps = learner, reps
    group = learner.minibatches(batch)[0][0]  # the first mini-batch's first group
    self.micro = {k: v[:1] for k, v in group.items()}  # one micro-batch: [1, m, T_b]
    m, width = self.micro["tokens"].shape[1:]
    self.shape = [int(m), int(width)]
    self.extra_forwards = int(learner.ref_params is not None)
    model = from_config("learner", learner.model().cfg)
    self.flops = learner_flops(model, np.full(m, width), self.extra_forwards)
    self._run()  # compiles

  def _run(self) -> float:
    import time

    import jax
    t = time.perf_counter()
    jax.block_until_ready(self.learner.gradients([self.micro]))
    return time.perf_counter() - t

  def sample(self) -> dict:
    t = statistics.median(self._run() for _ in range(self.reps))
    return {"learner_GFLOPs": self.flops / t / 1e9, "learner_micro_ms": 1e3 * t,
            "learner_micro_shape": self.shape}


def summarize(samples: list[dict], base: dict | None = None) -> dict:
  """Medians over ``samples`` (`Probe.sample`, with `LearnerProbe.sample`'s
  ``learner_GFLOPs`` where every sample has it) of the figures and rounds; each round's
  roofline on those figures (and ``base``'s efficiencies: `hardware.THIS_MACHINE_DEFAULTS`)
  and the residual; ``τ`` and ``λ`` fitted to the 1-slot residuals of both shapes
  (each clipped at 0: a negative fit means the roofline overstates forwards whose
  weights sit in cache, and no fixed cost shows above it); the `FULL_SLOTS` rounds predicted by the roofline plus
  ``τ + λ·L``, for comparison."""
  from spec_rl_jax.sim.hardware import THIS_MACHINE_DEFAULTS, this_machine_from
  figures = dict(base or THIS_MACHINE_DEFAULTS)
  for m in ("matmul_GFLOPs", "read_bandwidth_GBps", "learner_GFLOPs"):
    if all(m in s for s in samples):
      figures[m] = statistics.median(s[m] for s in samples)
  keyed = collections.defaultdict(list)
  for s in samples:
    for r in s["rounds_ms"]:
      keyed[(r["shape"], r["layers"], r["slots"])].append(r["round_ms"])
  chip = this_machine_from({**figures, "call_latency_ms": 0.0, "layer_latency_ms": 0.0})
  rows = []
  for (p, L, b), ts in keyed.items():
    from spec_rl_jax.sim.models import get_model
    layers = L or get_model(p).layers
    t = statistics.median(ts)
    roof = 1e3 * roofline_s(p, layers, chip, b)
    rows.append({"shape": p, "layers": layers, "slots": b, "round_ms": t,
                 "roofline_ms": roof, "residual_ms": t - roof})
  one = [r for r in rows if r["slots"] == 1]
  tau, lam = fit([(r["layers"], r["residual_ms"]) for r in one])
  figures["call_latency_ms"], figures["layer_latency_ms"] = max(tau, 0.0), max(lam, 0.0)
  for r in rows:
    r["predicted_ms"] = (r["roofline_ms"] + figures["call_latency_ms"]
                         + figures["layer_latency_ms"] * r["layers"])
  per_shape = {p: dict(zip(("call_latency_ms", "layer_latency_ms"),
                           fit([(r["layers"], r["residual_ms"]) for r in one
                                if r["shape"] == p]))) for p in SHAPES}
  return {"figures": figures, "rounds": rows, "fit_intercept_ms": tau, "fit_slope_ms": lam,
          "per_shape": per_shape, "samples": len(samples)}


def measure(samples: int = 5, reps: int = 3) -> dict:
  probe = Probe(reps)
  return summarize([probe.sample() for _ in range(samples)])


def report(res: dict) -> None:
  from spec_rl_jax.bench.common import print_table
  print_table(res["rounds"], ["shape", "layers", "slots", "round_ms", "roofline_ms",
                              "residual_ms", "predicted_ms"])
  f = res["figures"]
  print(f"matmul {f['matmul_GFLOPs']:.0f} GFLOP/s, read {f['read_bandwidth_GBps']:.1f} GB/s;"
        f" fit over both shapes at 1 slot: tau = {f['call_latency_ms']:.4f} ms per forward"
        f" (fit {res['fit_intercept_ms']:.4f}), lambda = {f['layer_latency_ms']:.4f} ms"
        f" per layer per forward (fit {res['fit_slope_ms']:.4f})")
  for p, g in res["per_shape"].items():
    print(f"  {p} alone: tau = {g['call_latency_ms']:.4f} ms, lambda = {g['layer_latency_ms']:.4f} ms")


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", default="results/sim_overhead.json")
  ap.add_argument("--samples", type=int, default=5)
  args = ap.parse_args(argv)
  res = measure(args.samples)
  report(res)
  res["rows"] = [{"metric": m, "value": v} for m, v in res["figures"].items()]
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(res, f, indent=1)
  print(f"wrote {args.out}")
  return res


if __name__ == "__main__":
  main()
