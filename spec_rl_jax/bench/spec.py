"""Speculative vs autoregressive rollouts: ``python -m spec_rl_jax.bench.spec``.

Workload: the default policy and draft model (``python -m spec_rl_jax.sft`` puts them in
the cache; ``--policy/--draft`` point elsewhere) and the policy's Eagle3 and MTP heads
when the cache holds them (``python -m spec_rl_jax.sft --target eagle3`` / ``mtp``;
``--eagle3``, ``--mtp``), prompts from the held-out split of the
built-in tasks, RL sampling (temperature 1, EOS on). For each batch size ``B`` (engine
slots) the engine runs AR (K = 0) and SD with each proposer at each ``K`` on
``max(B, MIN_REQUESTS)`` requests (at B=1 they run one after another: one response of
a few dozen tokens is too short to time); all systems of one ``B`` alternate A B A B
after a warm-up that compiles them (compile time reported apart; compiles met in a timed
run are counted and their seconds left out). Throughput counts emitted tokens only.

Peers at batch 1 (their only supported batch size), same exported weights, same
prompts one after another, same sampling: ``transformers`` assisted generation
(``assistant_model``) and prompt-lookup decoding (``prompt_lookup_num_tokens``), set up
for speed on the device JAX runs on (`common.torch_setup`, as in bench/rollout.py).

Where SD loses, a cost model from the same runs says why (`round_costs`): a round's
device-loop seconds (``decode_s / rounds``) in AR steps, the n-gram round at the same K
as the cost of verification (its drafting is nearly free), each model drafter's (draft
model, Eagle3 and MTP heads) drafting as the rest, and the speedup its acceptance would give with
drafting free.

Each proposer also runs with ``auto`` (spec/adaptive.py: the draft length chosen per
decode call, up to the largest K), and a draining workload (`_draining`: an RL-like
batch of 2x as many requests as slots with long-tailed lengths) compares AR, every
fixed K and ``auto`` on rollout time.

Writes JSON (``summary``: best SD/AR speedup per proposer at each B, ``auto`` vs AR and
vs the best fixed K with its rounds per k, the cost model at each model drafter's best K,
ours vs transformers assisted, and the draining workload's ratios) and a PNG of speedup
vs K per batch size, the free-drafting ceiling dashed.
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import time

import jax
import numpy as np

from spec_rl_jax.bench import common
from spec_rl_jax.compiles import CompileCounter


MIN_REQUESTS = 8  # requests per timed run, whatever the batch size
# Warm-up runs of an ``auto`` engine: its explorations compile the (k, S_c, M_c) programs
# it uses, as a long RL run does once (fixed-K engines compile theirs in one run).
WARMUP_AUTO = 3
FREE_DRAFTER = "ngram"  # drafts by matching token history: its rounds are verification
MODEL_DRAFTERS = ("draft_model", "eagle3", "mtp")  # proposers whose drafting runs a network


def round_costs(round_s: dict[str, float], acceptance: dict[str, float], ks,
                drafter: str = "draft_model") -> dict:
  """Cost model of a speculative round of ``drafter``, per draft length ``K``.

  ``round_s``: device-loop seconds per round of ``ar``, ``{drafter}_k{K}`` and
  `FREE_DRAFTER` ``_k{K}`` on the same requests; ``acceptance``: tokens per slot-round.
    round    the drafter's round in AR steps;
    verify   `FREE_DRAFTER`'s round in AR steps: the target forward over ``K + 1``
             positions, the rejection sampler and the bookkeeping, plus its matching
             (and every slot, busy or not: it reads siblings), so an upper bound;
    draft    ``round - verify``: the drafter's ``K`` steps (a lower bound);
    step     ``draft / K``: one draft step in AR steps;
    ceiling  ``α / verify``: the speedup of the drafter's acceptance ``α`` with
             drafting free (a lower bound).
  Returns ``{quantity: {K: value}}``.
  """
  out = {q: {} for q in ("round", "verify", "draft", "step", "ceiling")}
  for k in ks:
    dm = f"{drafter}_k{k}"
    out["round"][k] = round_s[dm] / round_s["ar"]
    out["verify"][k] = round_s[f"{FREE_DRAFTER}_k{k}"] / round_s["ar"]
    out["draft"][k] = out["round"][k] - out["verify"][k]
    out["step"][k] = out["draft"][k] / k
    out["ceiling"][k] = acceptance[dm] / out["verify"][k]
  return out


def _load(path: str):
  from spec_rl_jax import checkpoint
  if not os.path.exists(os.path.join(path, "config.json")):
    raise SystemExit(f"no checkpoint at {path}: run `python -m spec_rl_jax.sft` first"
                     " (it trains the default policy and draft model into the cache)")
  return checkpoint.load_model(path)  # this backend's attention kernels (auto)


def _prompts(tokenizer, n: int, seed: int = 0) -> list[list[int]]:
  from spec_rl_jax import data
  recs = data.mixed_records([data.Source.parse(s) for s in data.DEFAULT_SOURCES], "test",
                            seed)
  encode = data.SFTEncoder(tokenizer)  # the prompt template the models were trained on
  return [encode.prompt_ids(recs[i]) for i in range(n)]


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--quick", action="store_true")
  ap.add_argument("--out", default=common.default_out("spec"))
  ap.add_argument("--policy", default=None, help="HF checkpoint dir (default: cache/policy)")
  ap.add_argument("--draft", default=None, help="HF checkpoint dir (default: cache/draft)")
  ap.add_argument("--eagle3", default=None,
                  help="Eagle3 head dir (default: cache/eagle3, skipped when absent)")
  ap.add_argument("--mtp", default=None,
                  help="MTP heads dir (default: cache/mtp, skipped when absent)")
  ap.add_argument("--batch-sizes", default=None)
  ap.add_argument("--ks", default=None)
  args = ap.parse_args(argv)

  from spec_rl_jax.checkpoint import cache_dir
  from spec_rl_jax.rollout.types import EngineConfig, Request
  from spec_rl_jax.sampling import SamplingParams
  from spec_rl_jax.spec.proposers import build_proposer
  from spec_rl_jax.spec.proposers.draft_model import DraftModelConfig, DraftModelProposer

  policy_dir = args.policy or os.path.join(cache_dir(), "policy")
  draft_dir = args.draft or os.path.join(cache_dir(), "draft")
  policy, tokenizer = _load(policy_dir)
  draft, draft_tok = _load(draft_dir)
  batch_sizes = args.batch_sizes or ("1,8" if args.quick else "1,8,32")
  batch_sizes = [int(b) for b in batch_sizes.split(",")]
  ks = [int(k) for k in (args.ks or ("2,4" if args.quick else "1,2,3,4,6")).split(",")]
  reps = 2 if args.quick else 4
  max_new = 192
  sampling = SamplingParams(temperature=1.0)
  proposers = {
      "draft_model": lambda: DraftModelProposer(DraftModelConfig(), draft, draft_tok, tokenizer),
      "ngram": lambda: build_proposer("ngram", policy, max_ngram=4),
  }
  for name, marker in (("eagle3", "config.json"), ("mtp", "mtp_config.json")):
    path = os.path.abspath(getattr(args, name) or os.path.join(cache_dir(), name))
    if os.path.exists(os.path.join(path, marker)):
      proposers[name] = functools.partial(build_proposer, name, policy, tokenizer, path=path)
    else:
      print(f"no {name} heads at {path} (python -m spec_rl_jax.sft --target {name}):"
            " their rows are skipped")
  # Each proposer's draft lengths: the K asked for, up to the most it drafts (MTP: its
  # module count).
  pks = {p: [k for k in ks if k <= (make().draft_limit or k)] for p, make in proposers.items()}
  print(f"machine {common.machine_info()}; B={batch_sizes} K={pks} reps={reps}")

  rows, summary, curves, ceilings = [], {}, {}, {}
  for B in batch_sizes:
    prompts = _prompts(tokenizer, max(B, MIN_REQUESTS))
    max_seq = -(-(max(map(len, prompts)) + max_new + max(ks)) // 16) * 16
    cfg = EngineConfig(num_slots=B, page_size=16, num_pages=B * max_seq // 16,
                       max_seq_len=max_seq, max_new_tokens=max_new, round_budget=max_new,
                       sampling=sampling, eos_ids=tokenizer.eos_ids)
    engines = _engines(policy, cfg, proposers, pks)
    ids = iter(range(10**9))
    last, loop = {}, collections.defaultdict(lambda: np.zeros(2))  # (decode_s, rounds)
    compiles = collections.Counter()

    def run(name, engine):
      def go():
        with CompileCounter() as cc:
          last[name] = m = engine.generate([Request(p, next(ids)) for p in prompts]).metrics
        loop[name] += (m["decode_s"], m["rounds"])
        compiles[name] += cc.count
        return m["emitted_tokens"], cc.seconds
      return go

    for name, engine in engines.items():  # compile (reported apart)
      t = time.perf_counter()
      for _ in range(WARMUP_AUTO if name.endswith("_auto") else 1):
        run(name, engine)()
      rows.append({"case": f"B={B}", "system": name, "metric": "warmup_s",
                   "value": time.perf_counter() - t})
    loop.clear()
    compiles.clear()
    res = common.alternate({n: run(n, e) for n, e in engines.items()}, reps=reps, warmup=0,
                           baseline="ar")
    for name in engines:
      rows.append({"case": f"B={B}", "system": name, "metric": "tokens_per_s",
                   "value": res["rate"][name]})
      rows.append({"case": f"B={B}", "system": name, "metric": "compiles_in_timed_runs",
                   "value": compiles[name]})
      if name != "ar":
        rows.append({"case": f"B={B}", "system": name, "metric": "acceptance_length",
                     "value": last[name]["acceptance_length"]})
        rows.append({"case": f"B={B}", "system": name, "metric": "speedup_vs_ar",
                     "value": res["ratio"][name]})
    for p in proposers:
      sp = {k: res["ratio"][f"{p}_k{k}"] for k in pks[p]}
      curves[(B, p)] = sp
      best_k = max(sp, key=sp.get)
      summary[f"sd_{p}_vs_ar_b{B}"] = sp[best_k]
      summary[f"sd_{p}_best_k_b{B}"] = best_k
      summary[f"auto_{p}_vs_ar_b{B}"] = res["ratio"][f"{p}_auto"]
      summary[f"auto_{p}_vs_best_k_b{B}"] = res["ratio"][f"{p}_auto"] / sp[best_k]
      summary[f"auto_{p}_k_frac_b{B}"] = _k_fractions(last[f"{p}_auto"])
    for p in (p for p in MODEL_DRAFTERS if p in proposers):
      costs = round_costs({n: float(t / r) for n, (t, r) in loop.items()},
                          {n: m["acceptance_length"] for n, m in last.items()}, pks[p], p)
      ceilings[(B, p)] = costs["ceiling"]
      for q in costs:
        rows += [{"case": f"B={B}", "system": f"{p}_k{k}",
                  "metric": f"{q}_ar_steps" if q != "ceiling" else "free_draft_ceiling",
                  "value": costs[q][k]} for k in pks[p]]
      best_k = summary[f"sd_{p}_best_k_b{B}"]
      summary.update({f"{p}_{q}_ar_steps_b{B}": costs[q][best_k]
                      for q in ("round", "verify", "draft", "step")})
      summary[f"{p}_free_draft_ceiling_b{B}"] = costs["ceiling"][best_k]
      summary[f"{p}_acceptance_length_b{B}"] = {k: last[f"{p}_k{k}"]["acceptance_length"]
                                                for k in pks[p]}
    if B == 1:
      summary.update(_hf_peers(policy_dir, draft_dir, prompts, max_new, reps, ks,
                               engines, run, rows))
    # Every engine compiles its own programs; dropping this batch size's keeps the
    # process under the kernel's limit on memory maps (the JIT maps each executable).
    del engines
    jax.clear_caches()

  drain_rows, drain_summary = _draining(policy, tokenizer, proposers, pks, reps, args.quick,
                                        max_new)
  rows += drain_rows
  summary.update(drain_summary)
  common.print_table(rows, ["case", "system", "metric", "value"])
  print("\nsummary:", {k: round(v, 3) if isinstance(v, float) else v for k, v in summary.items()})
  result = common.write_results(args.out, "spec", args.quick, summary, rows)
  _plot(curves, ceilings, args.out)
  return result


def _engines(policy, cfg, proposers: dict, pks: dict) -> dict:
  """``ar``, ``{proposer}_k{K}`` for every fixed ``K`` in ``pks[proposer]`` and
  ``{proposer}_auto`` (the adaptive controller up to the largest), all on ``cfg``'s
  shape."""
  import dataclasses
  from spec_rl_jax.rollout.engine import RolloutEngine
  from spec_rl_jax.spec.adaptive import AdaptiveK
  engines = {"ar": RolloutEngine(policy, cfg)}
  for p, make in proposers.items():
    for k in pks[p]:
      engines[f"{p}_k{k}"] = RolloutEngine(
          policy, dataclasses.replace(cfg, max_draft_tokens=k), proposer=make())
    engines[f"{p}_auto"] = RolloutEngine(
        policy, dataclasses.replace(cfg, max_draft_tokens=max(pks[p])), proposer=make(),
        controller=AdaptiveK(max(pks[p])))
  return engines


def _k_fractions(metrics: dict) -> dict[int, float]:
  """The fraction of decode rounds at each draft length of one run."""
  total = max(sum(metrics["rounds_at_k"].values()), 1)
  return {k: v / total for k, v in sorted(metrics["rounds_at_k"].items())}


def _draining(policy, tokenizer, proposers, pks, reps, quick, max_new) -> tuple[list, dict]:
  """A rollout batch that drains as an RL step's does: ``S`` slots, ``2S`` requests with
  long-tailed response lengths (lognormal, median 40 tokens, clipped to 8..max_new; EOS
  off, so each response has its drawn length) and the trainer's round budget (64). AR,
  every fixed K and ``auto`` per proposer, alternated with AR proposer by proposer;
  rollout seconds compared."""
  from spec_rl_jax.rollout.types import EngineConfig, Request
  from spec_rl_jax.sampling import SamplingParams
  S = 16 if quick else 64
  rng = np.random.default_rng(0)
  lengths = np.clip(np.round(rng.lognormal(np.log(40), 0.8, 2 * S)), 8, max_new).astype(int)
  prompts = _prompts(tokenizer, 2 * S)
  K = max(max(v) for v in pks.values())
  max_seq = -(-(max(map(len, prompts)) + max_new + K) // 16) * 16
  cfg = EngineConfig(num_slots=S, page_size=16, num_pages=S * max_seq // 16,
                     max_seq_len=max_seq, max_new_tokens=max_new, round_budget=64,
                     sampling=SamplingParams(temperature=1.0))
  ids = iter(range(10**9))
  last, compiles = {}, collections.Counter()

  def run(name, engine):
    def go():
      reqs = [Request(p, next(ids), int(n)) for p, n in zip(prompts, lengths)]
      with CompileCounter() as cc:
        last[name] = engine.generate(reqs).metrics
      compiles[name] += cc.count
      return last[name]["emitted_tokens"], cc.seconds
    return go

  case = f"drain S={S}"
  print(f"{case}: {2 * S} requests, response lengths median {int(np.median(lengths))},"
        f" max {lengths.max()}", flush=True)
  rows, summary = [], {}
  # One proposer's engines (and AR) at a time, alternated among themselves: all of them
  # at once would hold more compiled programs than the kernel maps for one process.
  for p in proposers:
    engines = _engines(policy, cfg, {p: proposers[p]}, pks)
    for name, engine in engines.items():
      for _ in range(WARMUP_AUTO if name.endswith("_auto") else 1):
        run(name, engine)()
    compiles.clear()
    res = common.alternate({n: run(n, e) for n, e in engines.items()}, reps=reps, warmup=0,
                           baseline="ar")
    for n in engines:
      system = f"ar (with {p})" if n == "ar" else n
      rows += [{"case": case, "system": system, "metric": "speedup_vs_ar",
                "value": res["ratio"][n]},
               {"case": case, "system": system, "metric": "compiles_in_timed_runs",
                "value": compiles[n]},
               {"case": case, "system": system, "metric": "tokens_per_s",
                "value": res["rate"][n]}]
    fixed = {k: res["ratio"][f"{p}_k{k}"] for k in pks[p]}
    best = max(fixed, key=fixed.get)
    auto = res["ratio"][f"{p}_auto"]
    summary.update({f"drain_auto_{p}_vs_ar": auto, f"drain_{p}_best_fixed_k": best,
                    f"drain_{p}_best_fixed_vs_ar": fixed[best],
                    f"drain_auto_{p}_vs_best_fixed": auto / fixed[best],
                    f"drain_auto_{p}_k_frac": _k_fractions(last[f"{p}_auto"])})
    del engines
    jax.clear_caches()
  return rows, summary


def _hf_peers(policy_dir, draft_dir, prompts, max_new, reps, ks, engines, run, rows) -> dict:
  """transformers assisted generation and prompt lookup at B=1, alternated with ours."""
  import torch
  import transformers
  device = common.torch_setup()
  load = lambda d: transformers.AutoModelForCausalLM.from_pretrained(
      d, dtype=torch.float32, attn_implementation="sdpa").eval().to(device)
  hf, hf_draft = load(policy_dir), load(draft_dir)
  batches = [torch.as_tensor([p], device=device) for p in prompts]

  def hf_run(**kw):
    def go():
      emitted = 0
      with torch.inference_mode():
        for ids in batches:  # batch 1: one request after another, as our one slot does
          out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True,
                            temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=max_new, **kw)
          emitted += int(out.shape[1] - ids.shape[1])
      common.torch_sync(device)
      return emitted
    return go

  hf_systems = {
      "hf_plain": hf_run(),
      "hf_assisted": hf_run(assistant_model=hf_draft),  # adapts its draft length itself
      "hf_prompt_lookup": hf_run(prompt_lookup_num_tokens=max(ks)),
  }
  ours = {n: run(n, e) for n, e in engines.items() if n == "ar" or n.startswith("draft_model")}
  res = common.alternate({**hf_systems, **ours}, reps=reps, warmup=1, baseline="hf_assisted")
  for name in hf_systems:
    rows.append({"case": "B=1", "system": name, "metric": "tokens_per_s",
                 "value": res["rate"][name]})
  best = max((n for n in ours if n != "ar"), key=lambda n: res["ratio"][n])
  rows.append({"case": "B=1", "system": best, "metric": "speedup_vs_hf_assisted",
               "value": res["ratio"][best]})
  return {"ours_sd_vs_hf_assisted_b1": res["ratio"][best],
          "ours_ar_vs_hf_plain_b1": res["rate"]["ar"] / res["rate"]["hf_plain"],
          "ngram_peer_hf_prompt_lookup_vs_hf_plain_b1":
              res["rate"]["hf_prompt_lookup"] / res["rate"]["hf_plain"]}


def _plot(curves, ceilings, out) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(8.5, 4))
  for (B, p), sp in sorted(curves.items()):
    ks = sorted(sp)
    line, = ax.plot(ks, [sp[k] for k in ks], marker="o", label=f"{p}, B={B}")
    if (B, p) in ceilings:
      ax.plot(ks, [ceilings[(B, p)][k] for k in ks], ls="--", color=line.get_color(),
              label=f"{p}, B={B}, drafting free")
  ax.axhline(1.0, color="gray", lw=0.8)
  ax.set_xlabel("draft length K")
  ax.set_ylabel("speedup vs AR (tokens/s)")
  ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0))
  ax.grid(alpha=0.3)
  fig.tight_layout()
  common.save_plot(fig, out)


if __name__ == "__main__":
  main()
