"""Rollout engine vs ``transformers`` generate: ``python -m spec_rl_jax.bench.rollout``.

Both systems run the same ~110M-parameter Qwen3 weights (random init, exported with our
exporter and loaded by ``transformers``), the same prompts, greedy, a fixed number of
new tokens (no EOS), at batch sizes 1, 8 and 32, alternating A B A B in one process.

``transformers`` is set up as its users would for speed, on the device JAX runs on
(`common.torch_setup`): fp32, SDPA attention, ``torch.inference_mode``, KV cache on; on
CPU one torch thread per core, on a GPU CUDA with TF32 matmuls (JAX's GPU default).

Also reported: the machine's read bandwidth, the batch-1 bound ``bandwidth / bytes read
per token`` (all weights + the KV history read by attention), our fraction of it, and
the number of XLA compiles during the measured (post-warm-up) runs.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np

from spec_rl_jax.bench import common
from spec_rl_jax.compiles import CompileCounter
from spec_rl_jax.models import hf_io
from spec_rl_jax.models.config import ModelConfig
from spec_rl_jax.models.transformer import init_decoder, param_count
from spec_rl_jax.rollout.engine import RolloutEngine
from spec_rl_jax.rollout.types import EngineConfig, Request
from spec_rl_jax.sampling import SamplingParams

BENCH_MODEL = ModelConfig(
    arch="qwen3", vocab_size=8192, embed_dim=768, mlp_dim=3072, num_layers=12, num_heads=12,
    num_kv_heads=4, head_dim=64, rope_theta=1_000_000.0, qk_norm=True, tie_embeddings=True,
    max_position_embeddings=2048)


def _hf_generate(hf, prompts: np.ndarray, new_tokens: int, device: str):
  import torch
  ids = torch.as_tensor(prompts, device=device)
  with torch.inference_mode():
    hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
  common.torch_sync(device)


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--quick", action="store_true", help="fewer tokens and repetitions")
  ap.add_argument("--out", default=common.default_out("rollout"))
  ap.add_argument("--batch-sizes", default="1,8,32")
  args = ap.parse_args(argv)

  import torch
  import transformers
  device = common.torch_setup()

  prompt_len, new_tokens = (32, 32) if args.quick else (64, 128)
  reps = 2 if args.quick else 5
  batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
  cfg = BENCH_MODEL
  model = init_decoder(cfg, seed=0)
  n_params = param_count(model)
  tmp = tempfile.mkdtemp(prefix="bench_rollout_")
  hf_io.save_hf_checkpoint(model, tmp)
  hf = transformers.AutoModelForCausalLM.from_pretrained(
      tmp, dtype=torch.float32, attn_implementation="sdpa").eval().to(device)
  print(f"model: {n_params / 1e6:.1f}M params, fp32; prompt {prompt_len}, new {new_tokens};"
        f" {reps} reps; machine {common.machine_info()}; transformers on {device}")

  rng = np.random.default_rng(0)
  rows, summary = [], {}
  for B in batch_sizes:
    prompts = rng.integers(1, cfg.vocab_size, (B, prompt_len)).astype(np.int64)
    seq = prompt_len + new_tokens
    engine = RolloutEngine(model, EngineConfig(
        num_slots=B, page_size=16, num_pages=B * (-(-seq // 16)), max_seq_len=-(-seq // 16) * 16,
        max_new_tokens=new_tokens, round_budget=new_tokens, min_prefill_len=prompt_len,
        sampling=SamplingParams(temperature=0.0)))
    next_id = iter(range(10**9))
    ours = lambda: engine.generate([Request(p.tolist(), next(next_id)) for p in prompts]).responses
    theirs = lambda: _hf_generate(hf, prompts, new_tokens, device)

    with CompileCounter() as warm_compiles:
      t0 = time.perf_counter()
      first = ours()
      compile_s = time.perf_counter() - t0
    assert all(len(r.tokens) == new_tokens for r in first)
    with CompileCounter() as compiles:
      res = common.alternate({"transformers": theirs, "ours": ours}, reps=reps, warmup=1)
    tokens = B * new_tokens
    for name in ("transformers", "ours"):
      rows.append({"case": f"B={B}", "metric": "tokens_per_s", "system": name,
                   "value": tokens / res["median"][name]})
    ratio = res["ratio"]["ours"]
    summary[f"ours_vs_transformers_b{B}"] = ratio
    rows.append({"case": f"B={B}", "metric": "first_call_s (compile + run)", "system": "ours",
                 "value": compile_s})
    rows.append({"case": f"B={B}", "metric": "compiles_during_warmup", "system": "ours",
                 "value": warm_compiles.count})
    rows.append({"case": f"B={B}", "metric": "compiles_after_warmup", "system": "ours",
                 "value": compiles.count})
    summary[f"compiles_after_warmup_b{B}"] = compiles.count
    if B == 1:
      bw = common.measure_bandwidth()
      kv_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4 * (
          prompt_len + new_tokens / 2)  # mean history read per token
      bytes_per_token = n_params * 4 + kv_bytes
      bound = bw / bytes_per_token
      ours_tps = tokens / res["median"]["ours"]
      summary["roofline_fraction_b1"] = ours_tps / bound
      rows += [
          {"case": "B=1", "metric": "read_bandwidth_GBps", "system": "machine", "value": bw / 1e9},
          {"case": "B=1", "metric": "bytes_per_token_MB", "system": "bound",
           "value": bytes_per_token / 1e6},
          {"case": "B=1", "metric": "bound_tokens_per_s", "system": "bound", "value": bound},
      ]
  common.print_table(rows, ["case", "metric", "system", "value"])
  print("\nsummary:", {k: round(v, 3) for k, v in summary.items()})
  return common.write_results(args.out, "rollout", args.quick, summary, rows,
                              model={"params": n_params, "dtype": "float32",
                                     "prompt_len": prompt_len, "new_tokens": new_tokens})


if __name__ == "__main__":
  main()
