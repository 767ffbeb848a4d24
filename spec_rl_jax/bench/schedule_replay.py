"""The KV-aware scheduler over many workloads in seconds: recorded response lengths
replayed through the real `Scheduler`: ``python -m spec_rl_jax.bench.schedule_replay``.

`bench.sparse` times the policies on one workload with the engine; a policy's bytes and
throughput there hinge on that workload's lengths (which response is long, when it
starts). This benchmark replays AR rollouts host-only: per device call the engine's
loop runs up to ``round_budget`` rounds and returns when a slot needs a page, when (with
requests waiting) a slot finishes, or when few enough slots are busy for a smaller slot
bucket (compacted before the next call), exactly as `RolloutEngine.generate` drives the same
`Scheduler` (a test checks that the replay reproduces the engine's rounds, calls,
preemptions and bytes). Each AR round of a fixed-shape batch costs the same whatever
the number of busy slots, so *rounds* stand for time. A recompute restore re-prefills
the sequence: it is charged ``length / RECOMPUTE_TOKENS_PER_ROUND`` rounds. Host work
per call and the copies are not modelled (an offload + restore costs a fraction of one
round: docs/benchmarks.md).

Workloads: response lengths of the ``long-policy`` on the counting task (spans
100-500, ``max_seq_len`` 2560, temperature 1, as in `bench.sparse`; recorded with the
engine on first use, cached in ``--lengths``), 4 prompt seeds x 5 request sets (16, 32
and 64 requests), 8 slots, KV budgets of 0.25 / 0.35 / 0.5 of every slot at full
length. Each workload runs twice: *cold* (no earlier lengths: the first RL step) and
*warm* (after one call: kv_aware's length model has seen the same distribution, as in
every later RL step).

kv_aware runs at each of several ``recompute_max_tokens`` (0: always offload; larger:
fewer bytes, more prefill time); naive always offloads. Both share ``--grow-tokens``.

Writes JSON (``summary``: geometric means over the workloads of naive/kv_aware time
(throughput ratio) and bytes ratios, their minima, the fraction of workloads with >= 2x
fewer bytes at >= equal throughput and the tokens recomputed, at the default threshold
and per threshold) and a PNG of bytes ratio vs throughput ratio (default threshold).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import hashlib
import json
import os
from collections.abc import Sequence

import numpy as np

from spec_rl_jax.bench import common, sparse
from spec_rl_jax.rollout import buckets
from spec_rl_jax.rollout.paged_cache import PagePool
from spec_rl_jax.rollout.scheduler import Scheduler, SchedulerConfig


# Re-prefilling a sequence costs about one decode round per this many tokens, or less
# (measured with the engine on the long policy: docs/benchmarks.md).
RECOMPUTE_TOKENS_PER_ROUND = 64


@dataclasses.dataclass(frozen=True)
class ReplayRequest:
  """What the scheduler sees of a request, plus the response length it will have."""

  prompt: Sequence[int]
  request_id: int
  response_len: int  # tokens, 1..max_new (lengths do not depend on the schedule)
  max_new_tokens: int | None = None  # None: the replay's ``max_new``


def replay(requests: Sequence[ReplayRequest], config: SchedulerConfig, *, num_slots: int,
           num_pages: int, page_size: int, max_new: int, round_budget: int,
           history: Sequence[int] = ()) -> dict:
  """Runs AR rollouts of ``requests`` host-only through `Scheduler` (module docstring).

  Returns decode rounds, ``time`` (in rounds: plus the charge for recompute prefills),
  device calls, the scheduler's counters, pages moved (offload + restore), recomputed
  tokens, slot utilisation and the finished response lengths.
  """
  pool = PagePool(num_pages, page_size)
  sched = Scheduler(config, pool, num_slots, 1, requests,
                    lambda r: len(r.prompt) + (r.max_new_tokens or max_new), history)
  done = lambda q: q.length - len(q.request.prompt) + 1 >= q.request.response_len
  rounds = calls = moved = busy = recomputed = 0
  while sched.busy():
    for seq, mode in sched.plan_preemptions():
      saved = len(sched.filled_pages(seq)) if mode == "offload" else 0  # pages copied out
      moved += saved
      sched.preempt(seq, mode, saved)
    sched.grow()
    while (seq := sched.restore_next()) is not None:
      moved += seq.saved
      recomputed += seq.length if seq.mode == "recompute" else 0
      seq.saved, seq.mode = None, ""
    while sched.admit_next() is not None:
      pass
    calls += 1
    # Compaction and the stop at a smaller slot bucket, as rollout/slot_io.py does (AR).
    if sched.running and (buckets.slot_bucket(num_slots, len(sched.running))
                          < buckets.slot_bucket(num_slots, max(sched.running) + 1)):
      sched.compact()
    slots = buckets.slot_bucket(num_slots, max(sched.running, default=0) + 1)
    shrink_at = slots // 4 if slots % 4 == 0 and len(sched.running) > slots // 4 else 0
    stop_on_finish = bool(sched.queue or sched.preempted)
    live = {s: q for s, q in sched.running.items() if not done(q)}  # active slots
    finished = [s for s in sched.running if s not in live]  # ended at prefill
    n, newly = 0, False
    while (n < round_budget and len(live) > shrink_at and not (stop_on_finish and newly)
           and all(q.length + 1 <= len(q.pages) * page_size for q in live.values())):
      n += 1
      busy += len(live)
      for s, q in list(live.items()):
        q.length += 1
        if done(q):
          del live[s]
          finished.append(s)
          newly = True
    rounds += n
    for s in finished:
      sched.finish(s)
  return {"rounds": rounds, "time": rounds + recomputed / RECOMPUTE_TOKENS_PER_ROUND,
          "device_calls": calls, "moved_pages": moved, "recompute_tokens": recomputed,
          "slot_utilization": busy / max(rounds * num_slots, 1), **dict(sched.stats),
          "finished_lengths": list(sched.finished_lengths)}


def record_lengths(path: str, seeds: Sequence[int], n: int, spans: tuple[int, int],
                   max_seq: int) -> dict[str, list[tuple[int, int]]]:
  """``{seed: [(prompt_len, response_len)] * n}`` of the long-policy's responses (AR,
  temperature 1, unlimited KV budget), recorded once into ``path`` (again when the
  workload there differs: spans, positions, or the policy's weights)."""
  from spec_rl_jax.checkpoint import cache_dir
  policy, tok = sparse.ensure_long_models(("long-policy",))
  with open(os.path.join(cache_dir(), "long-policy", "model.safetensors"), "rb") as f:
    weights = hashlib.sha256(f.read()).hexdigest()[:16]
  workload = {"spans": list(spans), "max_seq": max_seq, "policy_sha256": weights}
  if os.path.exists(path):
    with open(path) as f:
      rec = json.load(f)
    if rec.get("workload") == workload and all(len(rec.get(str(s), ())) >= n for s in seeds):
      return rec
  from tqdm import tqdm

  from spec_rl_jax.rollout.engine import RolloutEngine
  from spec_rl_jax.rollout.types import EngineConfig, Request
  from spec_rl_jax.sampling import SamplingParams
  engine = RolloutEngine(policy, EngineConfig(
      num_slots=32, page_size=16, max_seq_len=max_seq, max_new_tokens=max_seq - 64,
      round_budget=64, sampling=SamplingParams(temperature=1.0), eos_ids=tok.eos_ids), tok)
  rec = {"workload": workload}
  for s in tqdm(seeds, desc="recording response lengths"):
    ps = sparse.prompts(tok, n, spans, s)
    res = engine.generate([Request(p, j) for j, p in enumerate(ps)])
    rec[str(s)] = [(len(p), len(r.tokens)) for p, r in zip(ps, res.responses)]
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    json.dump(rec, f)
  return rec


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--quick", action="store_true")
  ap.add_argument("--out", default=common.default_out("schedule_replay"))
  ap.add_argument("--lengths", default=os.path.join("results", "long_policy_lengths.json"),
                  help="recorded response lengths (recorded with the engine if missing)")
  ap.add_argument("--budgets", default="0.25,0.35,0.5",
                  help="KV pages as fractions of every slot at full length")
  ap.add_argument("--grow-tokens", type=int, default=128, help="both policies' chunk")
  default_limit = SchedulerConfig().recompute_max_tokens
  ap.add_argument("--recompute-max-tokens", default=f"0,64,{default_limit},512",
                  help="kv_aware's recompute thresholds to sweep (the summary headline"
                       f" is the default, {default_limit})")
  args = ap.parse_args(argv)
  seeds = [0, 1] if args.quick else [0, 1, 2, 3]
  sets = [(0, 32)] if args.quick else [(0, 16), (16, 32), (0, 32), (32, 64), (0, 64)]
  budgets = [float(b) for b in args.budgets.split(",")]
  limits = [int(x) for x in args.recompute_max_tokens.split(",")]
  S, max_seq, page_size = 8, sparse.MAX_SEQ, 16
  rec = record_lengths(args.lengths, seeds, max(hi for _, hi in sets), sparse.SPANS, max_seq)
  print(f"machine {common.machine_info()}; {S} slots, max_seq {max_seq}, budgets {budgets},"
        f" grow_tokens {args.grow_tokens}, recompute thresholds {limits}")

  rows = []
  for budget in budgets:
    for s in seeds:
      for lo, hi in sets:
        reqs = [ReplayRequest([0] * p, j, r) for j, (p, r) in enumerate(rec[str(s)][lo:hi])]
        run = lambda policy, history, limit=0: replay(
            copy.deepcopy(reqs), SchedulerConfig(policy=policy, grow_tokens=args.grow_tokens,
                                                 recompute_max_tokens=limit),
            num_slots=S, num_pages=int(budget * S * max_seq // page_size),
            page_size=page_size, max_new=max_seq - 64, round_budget=32, history=history)
        naive = run("naive", ())
        for limit in limits:
          cold = run("kv_aware", (), limit)
          for phase, kv in (("cold", cold),
                            ("warm", run("kv_aware", cold["finished_lengths"], limit))):
            rows.append({
                "budget": budget, "workload": f"seed{s}[{lo}:{hi}]", "phase": phase,
                "recompute_max_tokens": limit, "requests": hi - lo,
                "throughput_ratio": naive["time"] / kv["time"],
                "bytes_ratio": (naive["moved_pages"] / kv["moved_pages"] if kv["moved_pages"]
                                else float("inf") if naive["moved_pages"] else 1.0),
                "preemptions_naive": naive.get("preemptions", 0),
                "preemptions_kv_aware": kv.get("preemptions", 0),
                "moved_pages_naive": naive["moved_pages"],
                "moved_pages_kv_aware": kv["moved_pages"],
                "recompute_tokens_kv_aware": kv["recompute_tokens"],
                "utilization_naive": naive["slot_utilization"],
                "utilization_kv_aware": kv["slot_utilization"]})
  head = [r for r in rows if r["recompute_max_tokens"] == (
      default_limit if default_limit in limits else limits[0])]
  common.print_table(head, ["budget", "workload", "phase", "throughput_ratio", "bytes_ratio",
                            "preemptions_naive", "preemptions_kv_aware", "moved_pages_naive",
                            "moved_pages_kv_aware", "recompute_tokens_kv_aware"])
  sweep = {limit: _summarize([r for r in rows if r["recompute_max_tokens"] == limit])
           for limit in limits}
  summary = {**_summarize(head), "by_recompute_max_tokens": sweep}
  print("\nsummary (kv_aware vs naive; ratios > 1 favour kv_aware) by kv_aware's"
        " recompute_max_tokens:")
  common.print_table([{"recompute_max_tokens": limit, "phase": k, **v}
                      for limit, by_phase in sweep.items() for k, v in by_phase.items()],
                     ["recompute_max_tokens", "phase", *summary["warm"]])
  _plot(head, args.out)
  return common.write_results(args.out, "schedule_replay", args.quick, summary, rows)


def _summarize(rows) -> dict:
  """Per phase: geometric means and minima of the ratios over the workloads, and the
  share with >= 2x fewer bytes at >= equal throughput."""
  out = {}
  for phase in ("cold", "warm"):
    # Workloads where naive moves nothing have no bytes ratio to speak of.
    sel = [r for r in rows if r["phase"] == phase and r["moved_pages_naive"]]
    thr = np.array([r["throughput_ratio"] for r in sel])
    byt = np.array([r["bytes_ratio"] for r in sel])
    out[phase] = {
        "workloads": len(sel),
        "throughput_ratio_geomean": float(np.exp(np.log(thr).mean())),
        "throughput_ratio_min": float(thr.min()),
        "bytes_ratio_geomean": float(np.exp(np.log(np.minimum(byt, 1e3)).mean())),
        "bytes_ratio_min": float(byt.min()),
        "frac_2x_bytes_at_equal_throughput": float(np.mean((byt >= 2) & (thr >= 1))),
        "recompute_tokens_mean": float(np.mean([r["recompute_tokens_kv_aware"] for r in sel])),
    }
  return out


def _plot(rows, out: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(6, 4.5))
  for budget, marker in zip(sorted({r["budget"] for r in rows}), "osd^v"):
    sel = [r for r in rows if r["budget"] == budget and r["phase"] == "warm"
           and r["moved_pages_naive"]]
    ax.scatter([r["throughput_ratio"] for r in sel],
               [min(r["bytes_ratio"], 20) for r in sel], marker=marker,
               label=f"budget {budget:g}", alpha=0.7)
  ax.axvline(1.0, color="gray", ls="--")
  ax.axhline(2.0, color="gray", ls="--")
  ax.set(xlabel="throughput ratio kv_aware / naive (rounds + recompute prefills)",
         ylabel="KV bytes moved, naive / kv_aware", yscale="log",
         title="KV-aware scheduler vs naive (replayed workloads, warm)")
  ax.legend()
  ax.grid(alpha=0.3)
  common.save_plot(fig, out, bbox_inches="tight")


if __name__ == "__main__":
  main()
