"""The learner's update against this machine's matmul speed: ``python -m spec_rl_jax.bench.learner``.

`rl.learner.Learner.update` of the default policy (``default-policy``, 7.5M parameters,
`LearnerConfig` defaults: micro-batches of 32, one mini-batch) on random packed
rollouts (`ROLLOUTS`: 128 responses after 16-token prompts, about 40 and about 200
response tokens), in steady state: each case first runs updates on a few batches of
different lengths (`WARM_BATCHES`, compiling every micro-batch width they meet; the
compiles and their seconds are reported apart), then updates alternate with a matmul
probe (`matmul_probe`: a jitted fp32 1024³ matmul chained `PROBE_CHAIN` times, so one
probe samples the load for about as long as a micro-batch runs) in one process, A B A B.

Model FLOPs of one update: ``(6 + 2·f)·N·tokens``, ``N`` the policy's parameters,
``tokens`` the real (prompt + response) positions, not the padding the micro-batches
compute, ``f`` the extra forwards the learner runs (1 with a frozen reference, β > 0;
it recomputes no old log-probs: ``log π_old`` comes with the rollout). Attention's
``(6 + 2·f)·L·H·h·Σ T_i²`` (`sim.cost.learner_flops`) is not in the headline: it is
reported as its share on top (a few percent at these lengths).

Headline (`summary`): ``update_vs_matmul_flops_<case>`` = the median over pairs of the
update's model FLOP/s over the probe's FLOP/s. Breakdown rows per case: padding
(positions computed / real tokens), micro-batch shapes and seconds per micro-batch
(`Learner.gradients` alone), host seconds before the jitted calls (packing into
micro-batches), the optimizer step and metrics fetch (the update less its gradients),
and the compiles of updates on batches of new lengths after the warm-up.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from spec_rl_jax.bench import common
from spec_rl_jax.compiles import CompileCounter
from spec_rl_jax.config import LearnerConfig
from spec_rl_jax.models.config import get_preset
from spec_rl_jax.models.transformer import init_decoder, param_count
from spec_rl_jax.rl.learner import Learner, pack_rollouts

PROBE_N, PROBE_CHAIN = 1024, 16
WARM_BATCHES = 3  # batches of different lengths run before timing (all widths compiled)


@dataclasses.dataclass(frozen=True)
class Rollouts:
  """One step's random rollouts: ``responses`` of ``prompt_len`` + a response length
  drawn uniformly from ``[min_response, max_response]`` (the packed ``T`` is
  ``prompt_len + max_response``, as the trainer packs with ``max_new_tokens``)."""

  responses: int
  prompt_len: int
  min_response: int
  max_response: int


ROLLOUTS = {"resp40": Rollouts(128, 16, 32, 48), "resp200": Rollouts(128, 16, 100, 300)}
QUICK_ROLLOUTS = {"resp40": Rollouts(32, 16, 32, 48), "resp200": Rollouts(32, 16, 100, 300)}


def random_batch(r: Rollouts, vocab: int, seed: int) -> dict[str, np.ndarray]:
  """`pack_rollouts` of random prompts and responses drawn as ``r`` says, with random
  behaviour log-probs, advantages and rewards."""
  rng = np.random.default_rng(seed)
  prompts = rng.integers(1, vocab, (r.responses, r.prompt_len)).tolist()
  lengths = rng.integers(r.min_response, r.max_response + 1, r.responses)
  responses = [rng.integers(1, vocab, n).tolist() for n in lengths]
  old = [rng.normal(-4.6, 0.3, n).astype(np.float32) for n in lengths]
  return pack_rollouts(prompts, responses, old, rng.normal(size=r.responses),
                       rng.uniform(size=r.responses), r.prompt_len + r.max_response, 0)


def matmul_probe():
  """``(fn, flops)``: ``fn()`` runs `PROBE_CHAIN` dependent fp32 ``PROBE_N``³ matmuls
  (compiled on the first call) and waits for them."""
  a = jnp.full((PROBE_N, PROBE_N), 1.0 / PROBE_N, jnp.float32)
  chain = jax.jit(lambda a: jax.lax.fori_loop(0, PROBE_CHAIN, lambda _, x: x @ a, a))
  return lambda: chain(a).block_until_ready(), 2 * PROBE_N**3 * PROBE_CHAIN


def model_flops(n_params: int, tokens: int, extra_forwards: int) -> float:
  """``(6 + 2·f)·N·tokens``: forward + backward, plus ``f`` forwards."""
  return (6 + 2 * extra_forwards) * n_params * tokens


def attention_flops(cfg, seq_lens: np.ndarray, extra_forwards: int) -> float:
  """``(6 + 2·f)·L·H·h·Σ T_i²`` (causal QKᵀ and PV, as `sim.cost.learner_flops`)."""
  T = np.asarray(seq_lens, float)
  return float((6 + 2 * extra_forwards) * cfg.num_layers * cfg.num_heads * cfg.head_dim
               * np.sum(T * T))


def _timed(fn) -> float:
  t = time.perf_counter()
  jax.block_until_ready(fn())
  return time.perf_counter() - t


def run_case(name: str, r: Rollouts, learner: Learner, n_params: int, reps: int) -> tuple:
  """Times ``learner.update`` on ``r``'s rollouts against the matmul probe; returns
  ``(summary, rows)``."""
  cfg = learner.model().cfg
  batches = [random_batch(r, cfg.vocab_size, seed) for seed in range(WARM_BATCHES + 1)]
  with CompileCounter() as warm:
    t = time.perf_counter()
    for b in batches[:WARM_BATCHES]:
      learner.update(b)
    jax.block_until_ready(learner.state)
    warm_s = time.perf_counter() - t
  # A batch of new lengths after the warm-up: compiles only for a width not met yet.
  with CompileCounter() as late:
    learner.update(batches[WARM_BATCHES])
    jax.block_until_ready(learner.state)
  batch = batches[0]
  tokens = int(batch["valid"].sum())
  extra = int(learner.ref_params is not None)
  flops = model_flops(n_params, tokens, extra)
  probe, probe_flops = matmul_probe()
  probe()  # compiles outside the counted updates

  def update():
    learner.update(batch)
    jax.block_until_ready(learner.state)
    return flops

  def matmul():
    probe()
    return probe_flops

  with CompileCounter() as timed:
    res = common.alternate({"matmul": matmul, "update": update}, reps=reps, warmup=1,
                           baseline="matmul")
  update_s = res["median"]["update"]

  # Breakdown: host packing, the gradients alone, the rest (optimizer step, metrics).
  host_s = statistics.median(_timed(lambda: learner.minibatches(batch)) for _ in range(reps))
  groups = [g for mb in learner.minibatches(batch) for g in mb]
  grads_s = statistics.median(
      sum(_timed(lambda g=g: learner.gradients([g])) for g in groups) for _ in range(reps))
  micro = sum(g["tokens"].shape[0] for g in groups)
  computed = sum(g["tokens"].size for g in groups)
  shapes = sorted({tuple(g["tokens"].shape[1:]) for g in groups}, reverse=True)
  attn = attention_flops(cfg, batch["valid"].sum(1), extra)
  ratio = res["ratio"]["update"]
  summary = {f"update_vs_matmul_flops_{name}": ratio,
             f"compiles_after_warmup_{name}": late.count + timed.count}
  values = {
      "update_s": update_s, "update_GFLOPs": flops / update_s / 1e9,
      "matmul_GFLOPs": probe_flops / res["median"]["matmul"] / 1e9,
      "update_vs_matmul_flops": ratio,
      "update_vs_matmul_flops_on_computed_positions": ratio * computed / tokens,
      "model_GFLOP": flops / 1e9, "attention_flops_share_not_counted": attn / flops,
      "extra_forwards": extra, "real_tokens": tokens, "computed_positions": computed,
      "padding_frac": 1 - tokens / computed, "micro_batches": micro,
      "micro_batch_shapes": " ".join(f"{m}x{w}" for m, w in shapes),
      "gradients_s": grads_s, "s_per_micro_batch": grads_s / micro,
      "host_pack_s": host_s, "optimizer_and_fetch_s": max(update_s - grads_s - host_s, 0.0),
      "warmup_s (compile + run)": warm_s, "warmup_compiles": warm.count,
      "warmup_compile_s": warm.seconds, "compiles_new_lengths_after_warmup": late.count,
      "compiles_during_timed_updates": timed.count,
  }
  rows = [{"case": name, "metric": k, "value": v} for k, v in values.items()]
  return summary, rows


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--quick", action="store_true", help="32 responses per update, 2 pairs")
  ap.add_argument("--out", default=common.default_out("learner"))
  ap.add_argument("--preset", default="default-policy", help="the policy's model preset")
  ap.add_argument("--cases", default=",".join(ROLLOUTS), help="keys of ROLLOUTS")
  ap.add_argument("--responses", type=int, default=None, help="responses per update")
  ap.add_argument("--micro-batch-size", type=int, default=LearnerConfig.micro_batch_size)
  ap.add_argument("--kl-coef", type=float, default=0.0, help="β > 0: a reference forward")
  ap.add_argument("--reps", type=int, default=None)
  args = ap.parse_args(argv)

  rollouts = QUICK_ROLLOUTS if args.quick else ROLLOUTS
  reps = args.reps or (2 if args.quick else 5)
  cfg = get_preset(args.preset)
  lcfg = LearnerConfig(micro_batch_size=args.micro_batch_size, kl_coef=args.kl_coef)
  print(f"policy {args.preset}; learner micro-batches of {lcfg.micro_batch_size},"
        f" {lcfg.num_minibatches} mini-batch, kl_coef {lcfg.kl_coef}; {reps} pairs;"
        f" machine {common.machine_info()}")
  summary, rows = {}, []
  for name in args.cases.split(","):
    r = rollouts[name]
    if args.responses:
      r = dataclasses.replace(r, responses=args.responses)
    model = init_decoder(cfg, seed=0)
    n_params = param_count(model)
    learner = Learner(model, lcfg, r.max_response)  # donates the model's buffers
    s, case_rows = run_case(name, r, learner, n_params, reps)
    summary.update(s)
    rows += case_rows
  common.print_table(rows, ["case", "metric", "value"])
  print("\nsummary:", {k: round(v, 3) for k, v in summary.items()})
  return common.write_results(args.out, "learner", args.quick, summary, rows,
                              model={"preset": args.preset, "params": n_params,
                                     "dtype": cfg.param_dtype},
                              rollouts={k: dataclasses.asdict(v) for k, v in rollouts.items()},
                              flops="(6 + 2f)·N·real tokens; attention not counted")


if __name__ == "__main__":
  main()
