"""Held-out task accuracy of any checkpoint: pass@1 greedy, pass@1 sampled, pass@k.

``python -m spec_rl_jax.eval --model ~/.cache/spec_rl_jax/policy`` evaluates a HF
directory or a training run directory (`checkpoint.load_model`) on the test split of
each data source (default: the built-in tasks at their default difficulty).
``--draft PATH`` also measures how well a draft model predicts the policy: on the
policy's own sampled responses, the per-token speculative acceptance probability
``α = E[Σ_v min(p_v, q_v)]`` at temperature 1 and the greedy agreement
``E[argmax p == argmax q]``. ``--reference`` instead scores how exactly the model
reproduces the reference answers, by teacher forcing (`reference_exactness`): seconds
where generating long responses takes many minutes.

Generation goes through one rollout engine (`engine_for`), as in RL; the trainer
evaluates with its own engine (greedy and sampled requests differ only in their
per-request temperature).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import sys
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from spec_rl_jax import checkpoint, data
from spec_rl_jax.models.tokenizer import Tokenizer
from spec_rl_jax.models.transformer import Decoder, teacher_forced
from spec_rl_jax.rl import losses, rewards
from spec_rl_jax.rollout.engine import RolloutEngine
from spec_rl_jax.rollout.types import EngineConfig, Request
from spec_rl_jax.sampling import SamplingParams

# Shape legend: B batch, T time, V vocab.


EVAL_REQUEST_IDS = 1 << 30  # first request id of evaluation requests (RNG streams)


def engine_for(model: Decoder, tokenizer: Tokenizer, sources: Sequence[data.Source], n: int,
               seed: int = 0, temperature: float = 1.0,
               batch_size: int = 256) -> RolloutEngine:
  """A plain (AR) rollout engine sized for ``n`` held-out records of each source, with
  ``batch_size`` slots (the trainer evaluates with its own engine instead)."""
  encoder, page_size = data.SFTEncoder(tokenizer), 16
  records = [r for s in sources for r in s.held_out(n, seed)]
  max_new = _max_new_tokens(tokenizer, records)
  longest = max(len(encoder.prompt_ids(r)) for r in records) + max_new
  max_seq = -(-longest // page_size) * page_size + page_size
  slots = min(batch_size, len(records))
  return RolloutEngine(model, EngineConfig(
      num_slots=slots, page_size=page_size, num_pages=slots * max_seq // page_size,
      max_seq_len=max_seq, max_new_tokens=max_new, sampling=SamplingParams(temperature),
      eos_ids=tuple(tokenizer.eos_ids), seed=seed), tokenizer)


def generate(engine: RolloutEngine, prompts: Sequence[Sequence[int]], max_new_tokens: int,
             temperature: float, first_id: int = EVAL_REQUEST_IDS) -> list[list[int] | None]:
  """Response ids per prompt (EOS included when emitted) at ``temperature`` (0: greedy),
  at most ``max_new_tokens`` or what the engine leaves; ``None`` for prompts the
  engine has no room for. Request ids ``first_id + i`` key the draws: an engine with
  the same seed draws the same numbers at every evaluation."""
  sampling = dataclasses.replace(engine.config.sampling, temperature=temperature)
  requests = []
  for i, p in enumerate(prompts):
    room = min(max_new_tokens, engine.max_new_tokens_for(len(p)))
    if room >= 1:
      requests.append(Request(list(p), first_id + i, room, sampling=sampling))
  out: list[list[int] | None] = [None] * len(prompts)
  for r in engine.generate(requests).responses:
    out[r.request_id - first_id] = r.tokens
  return out


def pass_at_k(n: int, c: int, k: int) -> float:
  """Unbiased ``P(at least one of k samples correct)`` from ``c`` correct of ``n``."""
  if n - c < k:
    return 1.0
  return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def _max_new_tokens(tokenizer: Tokenizer, records) -> int:
  return max(len(tokenizer.encode(r["answer"])) for r in records) + 16


def score(tokenizer: Tokenizer, records, responses) -> list[float]:
  texts = [tokenizer.decode(r) for r in responses]
  return [rewards.reward_for(r, t) for r, t in zip(records, texts, strict=True)]


def evaluate_source(engine: RolloutEngine, tokenizer: Tokenizer, source: data.Source, n: int,
                    k: int, temperature: float = 1.0, seed: int = 0) -> dict[str, float]:
  """Accuracy on ``n`` held-out records of ``source`` (``k`` samples per prompt), generated
  by ``engine``; ``skipped`` counts records whose prompt does not fit it."""
  records = source.held_out(n, seed)
  encoder = data.SFTEncoder(tokenizer)
  prompts = [encoder.prompt_ids(r) for r in records]
  max_new = _max_new_tokens(tokenizer, records)
  greedy = generate(engine, prompts, max_new, 0.0)
  kept = [i for i, g in enumerate(greedy) if g is not None]
  records, prompts = [records[i] for i in kept], [prompts[i] for i in kept]
  if not kept:
    return {"n": 0, "skipped": len(greedy), "pass@1_greedy": math.nan,
            "pass@1_sampled": math.nan, f"pass@{k}": math.nan}
  greedy_ok = score(tokenizer, records, [greedy[i] for i in kept])
  sampled = generate(engine, [p for p in prompts for _ in range(k)], max_new, temperature,
                     EVAL_REQUEST_IDS + len(greedy))
  correct = np.asarray(score(tokenizer, [r for r in records for _ in range(k)], sampled))
  per_prompt = correct.reshape(len(records), k).sum(1)
  return {"n": len(records), "skipped": len(greedy) - len(records),
          "pass@1_greedy": float(np.mean(greedy_ok)),
          "pass@1_sampled": float(correct.mean()),
          f"pass@{k}": float(np.mean([pass_at_k(k, int(c), k) for c in per_prompt]))}


def evaluate(engine: RolloutEngine, tokenizer: Tokenizer, sources: Sequence[data.Source],
             n: int = 200, k: int = 8, temperature: float = 1.0,
             seed: int = 0) -> dict[str, dict[str, float]]:
  """`evaluate_source` for each source with one engine, keyed by `data.source_labels`."""
  return {label: evaluate_source(engine, tokenizer, s, n, k, temperature, seed)
          for label, s in zip(data.source_labels(sources), sources)}


def evaluate_model(model: Decoder, tokenizer: Tokenizer, sources: Sequence[data.Source],
                   n: int = 200, k: int = 8, temperature: float = 1.0,
                   seed: int = 0) -> dict[str, dict[str, float]]:
  """`evaluate` with an engine built for ``model`` (`engine_for`)."""
  engine = engine_for(model, tokenizer, sources, n, seed, temperature)
  return evaluate(engine, tokenizer, sources, n, k, temperature, seed)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _logits(graphdef, state, tokens, valid):
  """``logits[B, T, V]`` of right-padded ``tokens[B, T]``."""
  return teacher_forced(graphdef, state, tokens, valid).logits


def draft_acceptance(engine: RolloutEngine, draft: Decoder, policy: Decoder,
                     tokenizer: Tokenizer, source: data.Source, n: int,
                     seed: int = 0) -> dict[str, float]:
  """Acceptance statistics of ``draft`` for ``policy`` on the policy's temperature-1
  samples, generated by ``engine`` (which runs ``policy``)."""
  records = source.held_out(n, seed)
  encoder = data.SFTEncoder(tokenizer)
  prompts = [encoder.prompt_ids(r) for r in records]
  responses = generate(engine, prompts, _max_new_tokens(tokenizer, records), 1.0)
  seqs = [p + r for p, r in zip(prompts, responses) if r is not None]
  T = -(-max(map(len, seqs)) // 16) * 16
  tokens = np.full((len(seqs), T), tokenizer.pad_id, np.int32)
  valid = np.zeros((len(seqs), T), bool)
  mask = np.zeros((len(seqs), T), bool)  # positions whose next token is a response token
  prompts = [p for p, r in zip(prompts, responses) if r is not None]
  for b, (p, s) in enumerate(zip(prompts, seqs)):
    tokens[b, :len(s)], valid[b, :len(s)] = s, True
    mask[b, len(p) - 1:len(s) - 1] = True
  p = _logits(*nnx.split(policy), tokens, valid)  # [B, T, V]
  q = _logits(*nnx.split(draft), tokens, valid)
  alpha = np.asarray(losses.acceptance_prob(q, p))[mask]
  agree = np.asarray(p.argmax(-1) == q.argmax(-1))[mask]
  return {"acceptance_prob": float(alpha.mean()), "greedy_agreement": float(agree.mean())}


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _next_token_stats(graphdef, state, tokens, valid, targets):
  """``(argmax [B, T], log p(targets) [B, T])`` of each position's next-token
  distribution."""
  logp = jax.nn.log_softmax(_logits(graphdef, state, tokens, valid))  # [B, T, V]
  return logp.argmax(-1), jnp.take_along_axis(logp, targets[..., None], -1)[..., 0]


def reference_exactness(model: Decoder, prompts: Sequence[Sequence[int]],
                        references: Sequence[Sequence[int]],
                        batch_size: int = 8) -> dict[str, float]:
  """How exactly ``model`` reproduces ``references`` (response ids, EOS included),
  teacher-forced: one forward per example.

  * ``greedy_exact``: the fraction whose greedy decoding reproduces the reference,
    i.e. the argmax is the reference token at every response position given the
    reference prefix (a lower bound on greedy pass@1 where other answers also verify);
  * ``sampled_prob``: the mean probability ``exp(Σ_t log p(y_t | y_<t))`` that a
    temperature-1 sample is the reference;
  * ``token_error``: the fraction of response positions whose argmax is wrong;
  * ``first_error_frac``: where the first wrong argmax falls, as a fraction of the
    response length (mean over the examples that have one; NaN if none does).
  """
  graphdef, state = nnx.split(model)
  examples = [{"ids": np.asarray(list(p) + list(r), np.int32), "prompt_len": len(p)}
              for p, r in zip(prompts, references)]
  exact, probs, wrong, first = [], [], 0, []
  for i in range(0, len(examples), batch_size):
    batch = data.collate_sft(examples[i:i + batch_size], pad_id=0, max_len=sys.maxsize,
                             pad_multiple=64)  # no truncation
    argmax, logp = map(np.asarray, _next_token_stats(
        graphdef, state, batch["tokens"], batch["valid"], batch["targets"]))
    for b, response in enumerate(batch["loss_mask"] > 0):  # the response's positions
      miss = np.nonzero(argmax[b, response] != batch["targets"][b, response])[0]
      exact.append(len(miss) == 0)
      probs.append(math.exp(float(logp[b, response].sum())))
      wrong += len(miss)
      if len(miss):
        first.append(miss[0] / response.sum())
  return {"n": len(exact), "greedy_exact": float(np.mean(exact)),
          "sampled_prob": float(np.mean(probs)),
          "token_error": wrong / sum(map(len, references)),
          "first_error_frac": float(np.mean(first)) if first else float("nan")}


def source_reference_exactness(model: Decoder, tokenizer: Tokenizer, source: data.Source,
                               n: int, seed: int = 0) -> dict[str, float]:
  """`reference_exactness` on ``n`` held-out records of ``source`` (the reference: the
  record's answer, as SFT trains on it)."""
  encoder = data.SFTEncoder(tokenizer)
  examples = [encoder(r) for r in source.held_out(n, seed)]
  return reference_exactness(model, [e["ids"][:e["prompt_len"]].tolist() for e in examples],
                             [e["ids"][e["prompt_len"]:].tolist() for e in examples])


def main(argv: Sequence[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--model", default=os.path.join(checkpoint.cache_dir(), "policy"),
                      help="HF checkpoint directory or SFT run directory")
  parser.add_argument("--data", nargs="+", default=list(data.DEFAULT_SOURCES),
                      help="data sources (see spec_rl_jax.data.Source)")
  parser.add_argument("--n", type=int, default=200, help="held-out prompts per source")
  parser.add_argument("--k", type=int, default=8, help="samples per prompt")
  parser.add_argument("--temperature", type=float, default=1.0)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--draft", default=None, help="also measure this draft model")
  parser.add_argument("--reference", action="store_true",
                      help="score reproducing the reference answers, teacher-forced, instead of"
                      " generating (tasks with one answer, e.g. counting)")
  parser.add_argument("--out", default=None, help="write the results as JSON here")
  args = parser.parse_args(argv)
  model, tokenizer = checkpoint.load_model(args.model)
  if tokenizer is None:
    raise ValueError(f"{args.model} has no tokenizer")
  sources = [data.Source.parse(s) for s in args.data]
  engine = (None if args.reference and not args.draft else
            engine_for(model, tokenizer, sources, args.n, args.seed, args.temperature))
  if args.reference:
    results = {"model": args.model, "reference": {
        label: source_reference_exactness(model, tokenizer, s, args.n, args.seed)
        for label, s in zip(data.source_labels(sources), sources)}}
  else:
    results = {"model": args.model, "accuracy": evaluate(
        engine, tokenizer, sources, args.n, args.k, args.temperature, args.seed)}
  if args.draft:
    draft, _ = checkpoint.load_model(args.draft)
    results["draft"] = {
        label: draft_acceptance(engine, draft, model, tokenizer, s, args.n, args.seed)
        for label, s in zip(data.source_labels(sources), sources)}
  print(json.dumps(results, indent=2))
  if args.out:
    with open(args.out, "w") as f:
      json.dump(results, f, indent=2)


if __name__ == "__main__":
  main()
