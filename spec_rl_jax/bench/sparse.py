"""Self-sparse speculative rollouts and the KV-aware scheduler on the long-response
workload: ``python -m spec_rl_jax.bench.sparse``.

Workload: the counting task (tasks/counting.py: spans of 100-500 numbers, responses of
~450-2,500 tokens) with the ``long-policy`` / ``long-draft`` models (trained into the
cache on first use, about an hour on 2 CPU cores, 45 minutes of it the policy's three
stages: ``python -m spec_rl_jax.sft --target long-policy``), held-out prompts, RL
sampling (temperature 1). Throughput counts emitted tokens only.

Part 1 — decoding: AR (K = 0), ``self_sparse`` at several page budgets (fraction of
the slot's used pages) and K with the selection chosen once per round (the default),
per-step selection at one point (K = 4, budget 25%), and the ``draft_model`` proposer
for comparison; all systems alternate A B A B after a warm-up that compiles them, each
run 4 requests per slot (continuous batching keeps the slots busy, so the sampled
lengths' tail weighs little). Besides tokens/s and acceptance length it reports the KV
bytes read per emitted token by attention that reads only what it needs: per round the
verifier reads the whole context once, each sparse draft step the selected pages plus
the page key bounds; the per-round average context is taken from the responses (our
XLA reference attention reads every page of ``max_seq_len`` whatever the length, so
its real traffic is higher for AR and verification alike).

Part 2 — scheduler: 32 requests through 8 slots (4 per slot, as in part 1: with 2 per
slot the run's length hinges on when its longest response happens to start) under a KV
page budget of ``--kv-budget`` (default 0.35) of every slot at full length; the
``kv_aware`` policy vs ``naive`` (preempt newest, offload, no hysteresis), AR,
alternating: tokens/s, decode rounds and device calls, pages reclaimed (unused room
taken back instead of preempting), preemptions, offload + restore bytes, recompute
tokens, slot utilisation (means over the timed repetitions, each repetition's bytes
and throughput ratio, and the last one's utilisation trace per device call in the
JSON).

Writes JSON (``summary``: best self-sparse speedup over AR at budget <= 25%, the
crossover budget, acceptance lengths, scheduler bytes and throughput ratios) and a PNG of
acceptance length and speedup vs budget.
"""

from __future__ import annotations

import argparse
import math
import os

import numpy as np

from spec_rl_jax.bench import common
from spec_rl_jax.compiles import CompileCounter
from spec_rl_jax.tasks.counting import Counting


# The full workload (``--quick``: spans (30, 60), 384 positions); also `schedule_replay`'s:
# the task's default spans (the long models' training data), ~450-2,500-token responses.
SPANS = (Counting.min_span, Counting.max_span)
MAX_SEQ = 2560  # positions per slot, prompt included


def ensure_long_models(names=("long-policy", "long-draft")):
  """``(*models, tokenizer)``: the ``names`` models from the cache (default: policy and
  draft), training what is missing."""
  from spec_rl_jax import sft
  from spec_rl_jax.checkpoint import cache_dir, load_model
  missing = [n for n in names if not os.path.exists(os.path.join(cache_dir(), n, "config.json"))]
  if missing:
    print(f"training {missing} into {cache_dir()} (first use; a few minutes)")
    sft.produce(missing, {}, eval_n=0)
  # auto: this backend's attention kernels, the sparse draft kernel on TPU
  loaded = [load_model(os.path.join(cache_dir(), n)) for n in names]
  return (*(model for model, _ in loaded), loaded[0][1])


def prompts(tokenizer, n: int, spans: tuple[int, int], seed: int = 0):
  from spec_rl_jax import data
  src = data.Source.parse(f"task:counting?min_span={spans[0]},max_span={spans[1]}")
  recs = data.mixed_records([src], "test", seed)
  encode = data.SFTEncoder(tokenizer)
  return [encode.prompt_ids(recs[i]) for i in range(n)]


def kv_bytes_per_token(cfg, ctx: float) -> float:
  """KV bytes (K and V, all layers) of ``ctx`` positions."""
  return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4 * ctx


def read_per_emitted(system: str, cfg, draft_cfg, ctx: float, K: int, acc: float,
                     frac: float, page_size: int) -> float:
  """KV bytes attention reads per emitted token (module docstring)."""
  full = kv_bytes_per_token(cfg, ctx)
  if system == "ar":
    return full
  if system == "draft_model":
    return (full + K * kv_bytes_per_token(draft_cfg, ctx)) / acc
  pages = math.ceil(ctx / page_size)
  selected = min(pages, max(3, math.ceil(frac * pages))) * page_size
  bounds = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4 * pages
  return (full + K * (kv_bytes_per_token(cfg, selected) + bounds)) / acc


def decode_part(policy, draft, tok, quick, ps, base, fracs, ks, reps):
  """AR vs self-sparse (budgets x K, per-step vs per-round selection) vs draft model."""
  from spec_rl_jax.rollout.engine import RolloutEngine
  from spec_rl_jax.rollout.types import EngineConfig, Request
  from spec_rl_jax.spec.proposers import build_proposer
  from spec_rl_jax.spec.proposers.draft_model import DraftModelConfig, DraftModelProposer

  cfg, dcfg, page_size = policy.cfg, draft.cfg, base["page_size"]
  systems, meta, last = {}, {}, {}

  def add(name, K, proposer, frac=None):
    engine = RolloutEngine(policy, EngineConfig(max_draft_tokens=K, **base), tok, proposer)

    def run():  # the same requests every time: the warm-up compiles every path taken
      res = engine.generate([Request(p, j) for j, p in enumerate(ps)])
      last[name] = res
      return res.metrics["emitted_tokens"]

    systems[name], meta[name] = run, {"K": K, "frac": frac}

  add("ar", 0, None)
  for K in ks:
    for frac in fracs:
      add(f"sparse_f{frac}_k{K}", K, build_proposer("self_sparse", policy, budget=frac), frac)
  K0 = ks[-1] if quick else 4
  add(f"sparse_f0.25_k{K0}_step", K0,
      build_proposer("self_sparse", policy, budget=0.25, reselect=True), 0.25)
  add(f"draft_model_k{K0}", K0, DraftModelProposer(DraftModelConfig(), draft))
  for fn in systems.values():  # warm-up: compiles (timed runs must not compile)
    fn()
  with CompileCounter() as compiles:
    res = common.alternate(systems, reps=reps, warmup=0, baseline="ar")

  rows, curves = [], {}
  for name in systems:
    m = last[name].metrics
    lens = [len(r.tokens) for r in last[name].responses]
    ctx = float(np.mean([len(p) + n / 2 for p, n in zip(ps, lens)]))
    K, frac = meta[name]["K"], meta[name]["frac"]
    kind = "ar" if name == "ar" else ("draft_model" if name.startswith("draft") else "sparse")
    acc = m["acceptance_length"]
    row = {"system": name, "K": K, "budget": frac, "tokens_per_s": res["rate"][name],
           "speedup_vs_ar": res["ratio"][name], "acceptance_length": acc,
           "kv_bytes_per_token": read_per_emitted(kind, cfg, dcfg, ctx, K, acc, frac or 1.0,
                                                  page_size),
           "mean_response": float(np.mean(lens)), "slot_utilization": m["slot_utilization"]}
    rows.append(row)
    if kind == "sparse" and not name.endswith("_step"):
      curves.setdefault(K, []).append((frac, acc, res["ratio"][name]))
  cols = ["system", "K", "budget", "tokens_per_s", "speedup_vs_ar", "acceptance_length",
          "kv_bytes_per_token", "mean_response", "slot_utilization"]
  common.print_table(rows, cols)

  sparse = [r for r in rows if r["budget"] and not r["system"].startswith("draft")]
  small = [r for r in sparse if r["budget"] <= 0.25]
  best_k = max(small, key=lambda r: r["speedup_vs_ar"])["K"]
  wins = sorted(r["budget"] for r in sparse if r["K"] == best_k and r["speedup_vs_ar"] > 1.0)
  summary = {
      "self_sparse_best_speedup_vs_ar_budget_le_25pct": max(r["speedup_vs_ar"] for r in small),
      # Budgets (fraction of context) where self-sparse beats AR at the best K: the
      # crossovers are the ends of this range (None: it never wins here).
      "self_sparse_best_k": best_k,
      "self_sparse_winning_budgets": wins or None,
      "draft_model_speedup_vs_ar": res["ratio"][f"draft_model_k{K0}"],
      "reselect_step_vs_round_speedup": (res["rate"][f"sparse_f0.25_k{K0}_step"]
                                         / res["rate"][f"sparse_f0.25_k{K0}"]),
      "acceptance_length": {r["system"]: r["acceptance_length"] for r in rows if r["K"]},
      "compiles_during_timed_runs": compiles.count,
  }

  return rows, summary, curves


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--quick", action="store_true")
  ap.add_argument("--out", default=common.default_out("sparse"))
  ap.add_argument("--parts", default="decode,scheduler", help="decode and/or scheduler")
  ap.add_argument("--kv-budget", type=float, default=0.35,
                  help="scheduler part: KV pages as a fraction of every slot at full length")
  args = ap.parse_args(argv)
  parts = args.parts.split(",")

  from spec_rl_jax.sampling import SamplingParams

  policy, draft, tok = ensure_long_models()
  quick = args.quick
  B = 4 if quick else 8
  spans = (30, 60) if quick else SPANS
  max_seq = 384 if quick else MAX_SEQ
  page_size = 16
  fracs = [0.125, 0.25] if quick else [0.0625, 0.125, 0.25, 0.5, 1.0]
  ks = [4] if quick else [4, 8]
  reps = 1
  sampling = SamplingParams(temperature=1.0)
  ps = prompts(tok, 4 * B, spans)  # 4 per slot: a run's rate does not hinge on its longest
  base = dict(num_slots=B, page_size=page_size, max_seq_len=max_seq,
              max_new_tokens=max_seq - 64, round_budget=64, sampling=sampling,
              eos_ids=tok.eos_ids, num_pages=B * max_seq // page_size)
  print(f"machine {common.machine_info()}; B={B} spans={spans} budgets={fracs} K={ks}")

  rows, summary, sched_rows = [], {}, []
  if "decode" in parts:
    rows, summary, curves = decode_part(policy, draft, tok, quick, ps, base, fracs, ks, reps)
    _plot(curves, args.out)
  if "scheduler" in parts:
    sched_rows, sched = scheduler_part(policy, tok, quick,
                                       ps if quick else prompts(tok, 4 * B, spans, 1), base,
                                       args.kv_budget)
    summary.update(sched)
    print()
    common.print_table(sched_rows, ["policy", "tokens_per_s", "throughput_vs_naive",
                                    "rounds", "device_calls", "reclaimed_pages", "preemptions",
                                    "offloads", "recomputes", "kv_bytes_moved",
                                    "recompute_tokens", "slot_utilization"])
  print("\nsummary:", {k: v for k, v in summary.items() if k != "acceptance_length"})
  return common.write_results(args.out, "sparse", quick, summary,
                              rows + [dict(r, part="scheduler") for r in sched_rows])




def scheduler_part(policy, tok, quick, ps, base, kv_budget):
  """Tight KV budget: kv_aware vs naive (AR rollouts), alternating."""
  from spec_rl_jax.rollout.engine import RolloutEngine
  from spec_rl_jax.rollout.scheduler import SchedulerConfig
  from spec_rl_jax.rollout.types import EngineConfig, Request
  S = 4 if quick else 8
  page_size, max_seq = base["page_size"], base["max_seq_len"]
  cfg = dict(base, num_slots=S, num_pages=int(kv_budget * S * max_seq // page_size),
             round_budget=32)
  engines, runs = {}, {}
  for name in ("kv_aware", "naive"):
    engines[name] = RolloutEngine(policy, EngineConfig(
        scheduler=SchedulerConfig(policy=name, grow_tokens=128), **cfg), tok)

  def runner(name):
    def run():  # the same requests every time (compiles while timed are counted)
      m = engines[name].generate([Request(p, j) for j, p in enumerate(ps)]).metrics
      runs.setdefault(name, []).append(m)
      return m["emitted_tokens"]
    return run

  runners = {n: runner(n) for n in engines}
  for fn in runners.values():  # warm-up
    fn()
  runs.clear()
  with CompileCounter() as compiles:
    # 5 repetitions: single runs of the two policies differ by a few percent on a shared
    # machine
    res = common.alternate(runners, reps=1 if quick else 5, warmup=0, baseline="naive")
  # kv_aware's length estimate takes in every earlier call's responses, so its schedule
  # (and the bytes it moves) can differ between repetitions: means, and each one.
  moved = lambda m: m["offload_bytes"] + m["restore_bytes"]
  rows = []
  for name, ms in runs.items():
    mean = lambda f: float(np.mean([f(m) for m in ms]))
    rows.append({"policy": name, "tokens_per_s": res["rate"][name],
                 "throughput_vs_naive": res["ratio"][name],
                 **{k: mean(lambda m: m[k]) for k in (
                     "rounds", "device_calls", "reclaimed_pages", "preemptions", "offloads",
                     "recomputes", "recompute_tokens", "slot_utilization")},
                 "kv_bytes_moved": mean(moved), "kv_bytes_moved_per_rep": [moved(m) for m in ms],
                 "utilization_trace": ms[-1]["utilization_trace"]})
  by = {r["policy"]: r for r in rows}
  return rows, {
      "scheduler_kv_bytes_naive_over_kv_aware": (
          by["naive"]["kv_bytes_moved"] / by["kv_aware"]["kv_bytes_moved"]
          if by["kv_aware"]["kv_bytes_moved"] else float("inf")),
      "scheduler_throughput_kv_aware_vs_naive": res["ratio"]["kv_aware"],
      # the same in decode rounds, which the machine's noise does not touch (it leaves
      # out prefills, copies and host work per device call)
      "scheduler_rounds_naive_over_kv_aware": by["naive"]["rounds"] / by["kv_aware"]["rounds"],
      # per repetition (both policies emit the same responses: a time ratio)
      "scheduler_throughput_ratio_per_rep": [n / k for n, k in zip(res["times"]["naive"],
                                                                   res["times"]["kv_aware"])],
      "scheduler_kv_bytes_ratio_per_rep": [moved(n) / max(moved(k), 1) for n, k in
                                           zip(runs["naive"], runs["kv_aware"])],
      "scheduler_compiles_during_runs": compiles.count,
  }


def _plot(curves, out: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
  for K, pts in sorted(curves.items()):
    pts = sorted(pts)
    a1.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"K={K}")
    a2.plot([p[0] for p in pts], [p[2] for p in pts], "o-", label=f"K={K}")
  a1.set(xlabel="page budget (fraction of context)", ylabel="acceptance length",
         xscale="log")
  a2.axhline(1.0, color="gray", ls="--")
  a2.set(xlabel="page budget (fraction of context)", ylabel="speedup vs AR", xscale="log")
  budgets = sorted({p[0] for pts in curves.values() for p in pts})
  for a in (a1, a2):
    a.set_xticks(budgets, [f"{b:g}" for b in budgets])
    a.minorticks_off()
    a.legend()
    a.grid(alpha=0.3)
  fig.suptitle("self-sparse speculative rollouts (counting workload)")
  common.save_plot(fig, out, bbox_inches="tight")


if __name__ == "__main__":
  main()
