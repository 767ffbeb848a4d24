"""Reference autoregressive decoding over a `ContiguousKVCache`.

A fixed batch, one jitted prefill and one jitted ``lax.while_loop`` of decode steps.
It is the plain-AR reference that parity tests compare against (``transformers``
greedy, the rollout engine, speculative decoding) and the generator behind quick
evaluations. The rollout engine (``spec_rl_jax/rollout``) is the fast path.

Shape legend: ``B`` batch, ``T`` padded prompt length, ``N`` max new tokens.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from spec_rl_jax.models.kv_cache import ContiguousKVCache
from spec_rl_jax.models.transformer import Decoder
from spec_rl_jax.sampling import SamplingParams, process_logits, sample


class Generation(NamedTuple):
  tokens: list[list[int]]  # generated ids per prompt, EOS included when hit
  logprobs: list[list[float]]  # log p(token) under the processed distribution


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new", "params", "eos_ids"))
def _generate(graphdef, state, prompt, prompt_len, key, *, max_new: int,
              params: SamplingParams, eos_ids: tuple[int, ...]):
  model: Decoder = nnx.merge(graphdef, state)
  B, T = prompt.shape
  cache = ContiguousKVCache.init(model.cfg, B, T + max_new)
  positions = jnp.broadcast_to(jnp.arange(T), (B, T))
  out = model(prompt, positions, cache=cache, logits_at=(prompt_len - 1)[:, None])
  last = out.logits[:, 0]
  eos = jnp.asarray(eos_ids, jnp.int32)

  def pick(logits, step):
    lp = process_logits(logits, params)
    keys = jax.vmap(lambda b: jax.random.fold_in(jax.random.fold_in(key, b), step))(
        jnp.arange(B))
    tok = jax.vmap(sample)(keys, lp)
    return tok, jnp.take_along_axis(lp, tok[:, None], axis=-1)[:, 0]

  tok0, lp0 = pick(last, 0)
  toks = jnp.zeros((B, max_new), jnp.int32).at[:, 0].set(tok0)
  lps = jnp.zeros((B, max_new), jnp.float32).at[:, 0].set(lp0)
  done = jnp.isin(tok0, eos)

  def cond(c):
    step, _, _, _, done, _ = c
    return (step < max_new) & ~jnp.all(done)

  def body(c):
    step, cache, toks, lps, done, last_tok = c
    pos = (prompt_len + step - 1)[:, None]
    out = model(last_tok[:, None], pos, cache=cache)
    tok, lp = pick(out.logits[:, 0], step)
    tok = jnp.where(done, 0, tok)
    toks = toks.at[:, step].set(tok)
    lps = lps.at[:, step].set(jnp.where(done, 0.0, lp))
    return step + 1, out.cache, toks, lps, done | jnp.isin(tok, eos), tok

  _, _, toks, lps, _, _ = jax.lax.while_loop(
      cond, body, (jnp.int32(1), out.cache, toks, lps, done, tok0))
  return toks, lps


def generate(model: Decoder, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
             eos_ids: Sequence[int] = (), params: SamplingParams = SamplingParams(0.0),
             seed: int = 0, pad_to: int = 16) -> Generation:
  """Decodes ``max_new_tokens`` after each prompt (stopping a row at EOS).

  Prompts are right-padded to a multiple of ``pad_to`` so compiles stay few.
  """
  if not prompts or any(len(p) == 0 for p in prompts):
    raise ValueError("generate needs at least one prompt and no empty prompts")
  T = -(-max(len(p) for p in prompts) // pad_to) * pad_to
  prompt = np.zeros((len(prompts), T), np.int32)
  for i, p in enumerate(prompts):
    prompt[i, :len(p)] = p
  lens = np.asarray([len(p) for p in prompts], np.int32)
  graphdef, state = nnx.split(model)
  toks, lps = _generate(graphdef, state, jnp.asarray(prompt), jnp.asarray(lens),
                        jax.random.key(seed), max_new=max_new_tokens, params=params,
                        eos_ids=tuple(int(e) for e in eos_ids))
  toks, lps = np.asarray(toks), np.asarray(lps)
  out_t, out_l = [], []
  for row_t, row_l in zip(toks, lps):
    n = max_new_tokens
    hits = np.flatnonzero(np.isin(row_t, list(eos_ids))) if eos_ids else []
    if len(hits):
      n = int(hits[0]) + 1
    out_t.append(row_t[:n].tolist())
    out_l.append(row_l[:n].tolist())
  return Generation(out_t, out_l)
