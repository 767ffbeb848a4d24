"""Speculative vs autoregressive rollouts: ``python -m spec_rl_jax.bench.spec``.

Workload: the default policy and draft model (``python -m spec_rl_jax.sft`` puts them in
the cache; ``--policy/--draft`` point elsewhere), prompts from the held-out split of the
built-in tasks, RL sampling (temperature 1, EOS on). For each batch size ``B`` (engine
slots) the engine runs AR (K = 0) and SD with each proposer at each ``K`` on
``max(B, MIN_REQUESTS)`` requests (at B=1 they run one after another: one response of
a few dozen tokens is too short to time); all systems of one ``B`` alternate A B A B
after a warm-up that compiles them (compile time reported apart). Throughput counts
emitted tokens only.

Peers at batch 1 (their only supported batch size), same exported weights, same
prompts one after another, same sampling: ``transformers`` assisted generation
(``assistant_model``) and prompt-lookup decoding (``prompt_lookup_num_tokens``), set up
for speed on the device JAX runs on (`common.torch_setup`, as in bench/rollout.py).

Writes JSON (``summary``: best SD/AR speedup per proposer at B=1 and B=8, ours vs
transformers assisted) and a PNG of speedup vs K per batch size.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from spec_rl_jax.bench import common


MIN_REQUESTS = 8  # requests per timed run, whatever the batch size


def _load(path: str):
  from spec_rl_jax.models import hf_io
  if not os.path.exists(os.path.join(path, "config.json")):
    raise SystemExit(f"no checkpoint at {path}: run `python -m spec_rl_jax.sft` first"
                     " (it trains the default policy and draft model into the cache)")
  return hf_io.load_hf_checkpoint(path)


def _prompts(tokenizer, n: int, seed: int = 0) -> list[list[int]]:
  from spec_rl_jax import data
  recs = data.mixed_records([data.Source.parse(s) for s in ("task:arithmetic", "task:countdown")],
                            "test", seed)
  encode = data.SFTEncoder(tokenizer)  # the prompt template the models were trained on
  return [encode.prompt_ids(recs[i]) for i in range(n)]


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--quick", action="store_true")
  ap.add_argument("--out", default=common.default_out("spec"))
  ap.add_argument("--policy", default=None, help="HF checkpoint dir (default: cache/policy)")
  ap.add_argument("--draft", default=None, help="HF checkpoint dir (default: cache/draft)")
  ap.add_argument("--batch-sizes", default=None)
  ap.add_argument("--ks", default=None)
  args = ap.parse_args(argv)

  from spec_rl_jax.checkpoint import cache_dir
  from spec_rl_jax.rollout.engine import RolloutEngine
  from spec_rl_jax.rollout.types import EngineConfig, Request
  from spec_rl_jax.sampling import SamplingParams
  from spec_rl_jax.spec.proposers import make_proposer

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
      "draft_model": lambda: make_proposer("draft_model", model=draft, tokenizer=draft_tok,
                                           policy_tokenizer=tokenizer),
      "ngram": lambda: make_proposer("ngram", max_ngram=4),
  }
  print(f"machine {common.machine_info()}; B={batch_sizes} K={ks} reps={reps}")

  rows, summary, curves = [], {}, {}
  for B in batch_sizes:
    prompts = _prompts(tokenizer, max(B, MIN_REQUESTS))
    max_seq = -(-(max(map(len, prompts)) + max_new + max(ks)) // 16) * 16
    engines = {}
    for name, K in [("ar", 0)] + [(p, k) for p in proposers for k in ks]:
      cfg = EngineConfig(num_slots=B, page_size=16, num_pages=B * max_seq // 16,
                         max_seq_len=max_seq, max_new_tokens=max_new, round_budget=max_new,
                         sampling=sampling, eos_ids=tokenizer.eos_ids, num_draft_tokens=K,
                         reference_len=0)
      engines[f"{name}" + (f"_k{K}" if K else "")] = RolloutEngine(
          policy, cfg, proposer=proposers[name]() if K else None)
    ids = iter(range(10**9))
    last = {}

    def run(name, engine):
      def go():
        last[name] = engine.generate([Request(p, next(ids)) for p in prompts])
        return last[name].metrics["emitted_tokens"]
      return go

    for name, engine in engines.items():  # compile (reported apart)
      t = time.perf_counter()
      run(name, engine)()
      rows.append({"case": f"B={B}", "system": name, "metric": "first_call_s",
                   "value": time.perf_counter() - t})
    res = common.alternate({n: run(n, e) for n, e in engines.items()}, reps=reps, warmup=0,
                           baseline="ar")
    for name in engines:
      rows.append({"case": f"B={B}", "system": name, "metric": "tokens_per_s",
                   "value": res["rate"][name]})
      if name != "ar":
        rows.append({"case": f"B={B}", "system": name, "metric": "acceptance_length",
                     "value": last[name].metrics["acceptance_length"]})
        rows.append({"case": f"B={B}", "system": name, "metric": "speedup_vs_ar",
                     "value": res["ratio"][name]})
    for p in proposers:
      sp = {k: res["ratio"][f"{p}_k{k}"] for k in ks}
      curves[(B, p)] = sp
      best_k = max(sp, key=sp.get)
      summary[f"sd_{p}_vs_ar_b{B}"] = sp[best_k]
      summary[f"sd_{p}_best_k_b{B}"] = best_k
    if B == 1:
      summary.update(_hf_peers(policy_dir, draft_dir, prompts, max_new, reps, ks,
                               engines, run, rows))

  common.print_table(rows, ["case", "system", "metric", "value"])
  print("\nsummary:", {k: round(v, 3) if isinstance(v, float) else v for k, v in summary.items()})
  result = common.write_results(args.out, "spec", args.quick, summary, rows)
  _plot(curves, ks, args.out)
  return result


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


def _plot(curves, ks, out) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(6, 4))
  for (B, p), sp in sorted(curves.items()):
    ax.plot(ks, [sp[k] for k in ks], marker="o", label=f"{p}, B={B}")
  ax.axhline(1.0, color="gray", lw=0.8)
  ax.set_xlabel("draft length K")
  ax.set_ylabel("speedup vs AR (tokens/s)")
  ax.legend(fontsize=8)
  ax.grid(alpha=0.3)
  fig.tight_layout()
  common.save_plot(fig, out)


if __name__ == "__main__":
  main()
