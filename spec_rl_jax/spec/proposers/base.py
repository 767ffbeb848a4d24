"""The proposer interface and registry.

A proposer drafts ``K`` tokens per slot each speculative round. It sees the engine's
slot bookkeeping through `DraftContext`, keeps whatever device state it needs (a draft
model's paged KV pools, nothing for n-gram), and returns the drafts with their
processed distribution ``q`` (``[S, K, V]`` log-probs) or ``None`` for a point mass.
It never touches the verifier: exactness is the verifier's job, whatever is proposed.

Shape legend: ``S`` slots, ``K`` draft length, ``V`` vocab, ``n`` prefill batch,
``T`` prefill length, ``M`` pages per slot, ``Lh`` history length.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp

from spec_rl_jax.rollout.types import EngineConfig
from spec_rl_jax.sampling import inverse_cdf, process_logits


class DraftContext(NamedTuple):
  """What a proposer may read about the slots at the start of a round."""

  last: jax.Array  # [S] int32: the newest token (position ``length``), not yet in KV
  length: jax.Array  # [S] int32: tokens in the target KV cache
  active: jax.Array  # [S] bool
  rid: jax.Array  # [S] int32: request ids (RNG streams)
  group: jax.Array  # [S] int32: prompt-group ids (GRPO siblings share one)
  history: jax.Array  # [S, Lh] int32: prompt + emitted tokens by position
  reference: jax.Array  # [S, R] int32: earlier rollouts of the slot's prompt (-1 pad)
  page_table: jax.Array  # [S, M] int32: the slot's KV pages (shared by draft caches)
  key: jax.Array  # the engine's base PRNG key
  target_params: Any  # the policy's weights (self-drafting proposers read them)
  cache: Any  # the policy's PagedKVCache: positions < ``length`` (read only)


class Proposer(Protocol):
  """Device-side drafting. ``params`` (weights, never donated) and ``state`` (caches,
  donated with the engine state) are pytrees; the methods are traced inside the
  engine's jitted calls.

  ``reads_other_slots``: a slot's drafts depend on other slots' rows (n-gram siblings).
  The engine then keeps every slot in every decode call instead of running only the
  busy leading slots (rollout/engine.py), which would hide finished siblings.
  """

  reads_other_slots: bool

  def params(self, rows: int) -> Any:
    """Weights the proposer reads (``None`` if none), laid out for drafting ``rows``
    slots at a time (`transformer.inference_weights`)."""

  def init_state(self, config: EngineConfig) -> Any:
    """The proposer's mutable device state."""

  def prefill(self, params: Any, state: Any, tokens: jax.Array, positions: jax.Array,
              pages: jax.Array) -> Any:
    """Sees the prompts being inserted: ``tokens[n, T]``, ``positions[n, T]`` (pads
    negative, right-aligned as in rollout/paged_cache.py), ``pages[n, M]``."""

  def propose(self, params: Any, state: Any, ctx: DraftContext, num_draft: int,
              sampling) -> tuple[jax.Array, jax.Array | None, Any]:
    """Returns ``(drafts [S, K], draft logprobs [S, K, V] or None, state)``."""


_REGISTRY: dict[str, Callable[..., Proposer]] = {}


def register(name: str):
  def deco(factory):
    _REGISTRY[name] = factory
    return factory
  return deco


def make_proposer(name: str, **kwargs) -> Proposer:
  """Builds the proposer registered as ``name`` (``draft_model``, ``ngram``, ...)."""
  if name not in _REGISTRY:
    raise ValueError(f"unknown proposer {name!r}; registered: {sorted(_REGISTRY)}")
  return _REGISTRY[name](**kwargs)


def draft_key(key: jax.Array, rid: jax.Array, pos: jax.Array) -> jax.Array:
  """Per-slot key for the draft tokens of the round whose first draft sits at ``pos``
  — a stream disjoint from the verifier's (which folds ``rid`` then ``pos`` into
  ``key`` directly)."""
  return jax.vmap(lambda r, p: jax.random.fold_in(
      jax.random.fold_in(jax.random.fold_in(key, 0x5EED), r), p))(rid, pos)


def sample_drafts(step: Callable[[Any, jax.Array, int], tuple[Any, jax.Array]], carry: Any,
                  logits: jax.Array, ctx: DraftContext, num_draft: int, sampling
                  ) -> tuple[jax.Array, jax.Array, Any]:
  """Autoregressive drafting from a model: ``x_1 ~ q_1`` from ``logits [S, V]`` (the
  draft's prediction for position ``length + 1``), then for ``i = 1..K-1``
  ``step(carry, x_i, i) -> (carry, logits of q_{i+1})`` feeds ``x_i`` at ``length + i``.

  ``q`` is the processed sampling distribution (spec/verifier.py applies the same
  processing to ``p``). Returns ``(drafts [S, K], logprobs [S, K, V], carry)``.
  """

  keys = draft_key(ctx.key, ctx.rid, ctx.length + 1)
  u = jax.vmap(lambda k: jax.random.uniform(k, (num_draft,)))(keys)  # [S, K]: one per draft

  def draw(logits, i):
    lp = process_logits(logits, sampling)  # [S, V]
    return inverse_cdf(u[:, i], jnp.exp(lp)), lp

  x, lp = draw(logits, 0)

  def body(c, i):
    carry, x = c
    carry, logits = step(carry, x, i)
    nxt, lp = draw(logits, i)
    return (carry, nxt), (nxt, lp)

  (carry, _), (xs, lps) = jax.lax.scan(body, (carry, x), jnp.arange(1, num_draft))
  drafts = jnp.concatenate([x[:, None], xs.T], axis=1)  # [S, K]
  logprobs = jnp.concatenate([lp[:, None], lps.transpose(1, 0, 2)], axis=1)  # [S, K, V]
  return drafts, logprobs, carry
