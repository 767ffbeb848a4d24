"""The proposer protocol and registry.

Glossary (one speculative round of the rollout engine, rollout/device.py):

  propose   ``propose(weights, state, ctx, k, sampling) -> (drafts [S, k], q, state)``:
            ``k`` draft tokens per slot and their processed distribution ``q``
            (``[S, k, V]`` log-probs: ``sampling``'s top-k / top-p at each slot's
            ``ctx.temperature``) or ``None`` for a point mass. ``k`` is chosen by
            the host per decode call (``1 <= k <= K_max``); a call with ``k = 0`` is a
            plain AR round and runs none of the proposer's code.
  verify    the engine's target forward over ``[last, drafts]`` (``k + 1`` positions)
            and the exact rejection sampler (spec/verifier.py). A proposer never
            touches either: exactness holds whatever it proposes.
  observe   ``observe(weights, state, feedback) -> state`` after acceptance is known,
            with the emitted tokens and the hidden states of the policy layers the
            proposer declared in ``hidden_layers`` (`Feedback`).
  prefill   ``prefill(weights, state, batch) -> state`` when prompts are inserted
            (and when the engine resynchronises a proposer with ``catches_up`` after
            calls with ``k = 0``): ``tokens [n, T]`` at ``positions [n, T]`` and the
            policy's hidden states of those tokens (`PrefillBatch`).

State: `ProposerState` holds ``pools`` (page pools ``[L, Hk, P, ...]`` that share the
policy's page table: preemption moves their pages with the policy's) and ``rows``
(``[S, ...]`` per-slot arrays that move with their sequence). Host-side hooks give the
per-request rows at admission (`Proposer.request_rows`), see finished responses
(`Proposer.on_finished`) and checkpoint host memory (`Proposer.host_state`).

Shape legend: ``S`` slots, ``k`` draft length of the call, ``K_max`` the most any call
drafts, ``V`` vocab, ``D`` model dim, ``h`` declared hidden layers, ``n`` prefill batch,
``T`` prefill length, ``M`` pages per slot, ``Lh`` history length.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from spec_rl_jax.sampling import inverse_cdf, process_logits


class DraftContext(NamedTuple):
  """What a proposer may read about the slots at the start of a round."""

  last: jax.Array  # [S] int32: the newest token (position ``length``), not yet in KV
  length: jax.Array  # [S] int32: tokens in the target KV cache
  active: jax.Array  # [S] bool
  rid: jax.Array  # [S] int32: request ids (RNG streams)
  group: jax.Array  # [S] int32: prompt-group ids (GRPO siblings share one)
  history: jax.Array  # [S, Lh] int32: prompt + emitted tokens by position
  page_table: jax.Array  # [S, M] int32: the slot's KV pages (shared by draft caches)
  key: jax.Array  # the engine's base PRNG key
  temperature: jax.Array  # [S] fp32: the request's sampling temperature (0: greedy)
  target_weights: Any  # the policy's weights (self-drafting proposers read them)
  cache: Any  # the policy's PagedKVCache: positions < ``length`` (read only)


class Feedback(NamedTuple):
  """What the round's verification found, for `Proposer.observe`.

  ``inputs[s, i]`` sat at ``positions[s, i] = length + i`` (``i = 0..k``: ``last``, then
  the drafts); ``hidden[j, s, i]`` is the output of layer ``hidden_layers[j]`` at that
  position. The round emitted ``tokens[s, :num_emitted[s]]``: inputs ``1..n-1`` were
  accepted and ``tokens[s, n-1]`` is the correction or bonus token (the new ``last``).
  Only hidden states at ``i < num_emitted`` belong to the sequence from now on.
  """

  inputs: jax.Array  # [S, k+1] int32
  positions: jax.Array  # [S, k+1] int32 (-1: inactive slot)
  tokens: jax.Array  # [S, k+1] int32
  num_emitted: jax.Array  # [S] int32 (0: inactive slot)
  hidden: jax.Array | None  # [h, S, k+1, D] or None (no hidden layers declared)
  page_table: jax.Array  # [S, M] int32
  target_weights: Any  # the policy's weights (heads read its embedding and LM head)


class PrefillBatch(NamedTuple):
  """Prompts (or, on resynchronisation, whole sequences) entering slots."""

  slots: jax.Array  # [n] int32 (S: padding, dropped)
  tokens: jax.Array  # [n, T] int32, left-padded
  positions: jax.Array  # [n, T] int32 (pads negative, right-aligned as in paged_cache.py)
  pages: jax.Array  # [n, M] int32
  hidden: jax.Array | None  # [h, n, T, D] or None
  target_weights: Any  # the policy's weights


@struct.dataclass
class ProposerState:
  """A proposer's device state: page pools sharing the policy's page table, and
  per-slot rows (see the module docstring). Either may be an empty tuple."""

  pools: Any = ()
  rows: Any = ()


class Proposer:
  """Base class: every hook has a no-op default except `propose`.

  Subclasses set ``name`` (the registry key) and ``Config`` (a frozen dataclass of their
  options) and are built by ``build(config, policy, tokenizer, mesh)``.

  ``reads_other_slots``: a slot's drafts depend on other slots' rows (n-gram siblings),
  so the engine runs every slot in every decode call rather than only the busy ones.
  ``hidden_layers``: policy layers whose outputs the verification forward (and prefill)
  return for `observe` / `prefill`; empty = nothing extra computed.
  ``catches_up``: the device state must have seen every position (a KV cache); after
  decode calls with ``k = 0`` the engine re-prefills it before drafting again.
  """

  name: ClassVar[str] = ""
  Config: ClassVar[type] = type(None)
  reads_other_slots: ClassVar[bool] = False
  catches_up: ClassVar[bool] = False
  hidden_layers: tuple[int, ...] = ()

  def __init__(self, config: Any):
    if not isinstance(config, self.Config):
      raise TypeError(f"{self.name} proposer needs a {self.Config.__name__}, got"
                      f" {type(config).__name__}")
    self.config = config

  @classmethod
  def build(cls, config: Any, policy, tokenizer=None, mesh=None) -> "Proposer":
    """The proposer for ``policy`` (its `Decoder`) and ``tokenizer``; its weights, if
    any, on ``mesh`` by the sharding rules (the learner's, which trains and checkpoints
    them; the engine keeps its own copy on its mesh)."""
    del policy, tokenizer, mesh
    return cls(config)

  # ---------------------------------------------------------------- weights

  @property
  def draft_limit(self) -> int | None:
    """The most drafts one round can take (None: any ``K``)."""
    return None

  @property
  def vocab_size(self) -> int | None:
    """Vocabulary of the drafts (None: the policy's own)."""
    return None

  def model(self):
    """The drafter's own `Decoder` (trainable weights), or ``None``."""
    return None

  def set_model(self, model) -> None:
    raise ValueError(f"the {self.name} proposer has no weights to set")

  # ---------------------------------------------------------------- device side

  def init_state(self, engine_config) -> ProposerState:
    del engine_config
    return ProposerState()

  def prefill(self, weights, state: ProposerState, batch: PrefillBatch) -> ProposerState:
    del weights, batch
    return state

  def propose(self, weights, state: ProposerState, ctx: DraftContext, num_draft: int,
              sampling) -> tuple[jax.Array, jax.Array | None, ProposerState]:
    raise NotImplementedError

  def observe(self, weights, state: ProposerState, feedback: Feedback) -> ProposerState:
    del weights, feedback
    return state

  # ---------------------------------------------------------------- host side

  def request_rows(self, request) -> Mapping[str, np.ndarray]:
    """This request's values of ``state.rows`` (one row each), set at admission."""
    del request
    return {}

  def on_finished(self, request, tokens: list[int]) -> None:
    del request, tokens

  def host_state(self) -> dict:
    """Host memory to checkpoint (JSON-able)."""
    return {}

  def load_host_state(self, state: dict) -> None:
    del state


_REGISTRY: dict[str, type[Proposer]] = {}


def register(cls: type[Proposer]) -> type[Proposer]:
  if not cls.name or not dataclasses.is_dataclass(cls.Config):
    raise TypeError(f"{cls.__name__} needs a name and a Config dataclass")
  _REGISTRY[cls.name] = cls
  return cls


def registry() -> dict[str, type[Proposer]]:
  """Registered proposer classes by name."""
  return dict(_REGISTRY)


def proposer_class(name: str) -> type[Proposer]:
  if name not in _REGISTRY:
    raise ValueError(f"unknown proposer {name!r}; registered: {sorted(_REGISTRY)}")
  return _REGISTRY[name]


def build_proposer(name: str, policy, tokenizer=None, mesh=None, config: Any = None,
                   **options) -> Proposer:
  """``proposer_class(name).build(config, policy, tokenizer, mesh)``; ``options`` are
  the fields of its ``Config`` when no ``config`` is given."""
  cls = proposer_class(name)
  if config is None:
    valid = [f.name for f in dataclasses.fields(cls.Config)]
    unknown = sorted(set(options) - set(valid))
    if unknown:
      raise ValueError(f"unknown {name} option(s) {unknown}; valid: {valid}")
    config = cls.Config(**options)
  elif options:
    raise ValueError("give either config or options, not both")
  return cls.build(config, policy, tokenizer, mesh)


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
  draft's prediction for position ``length + 1``), then for ``i = 1..k-1``
  ``step(carry, x_i, i) -> (carry, logits of q_{i+1})`` feeds ``x_i`` at ``length + i``.

  ``q`` is the processed sampling distribution (spec/verifier.py applies the same
  processing to ``p``). Returns ``(drafts [S, k], logprobs [S, k, V], carry)``.
  """

  keys = draft_key(ctx.key, ctx.rid, ctx.length + 1)
  u = jax.vmap(lambda k: jax.random.uniform(k, (num_draft,)))(keys)  # [S, k]: one per draft

  def draw(logits, i):
    lp = process_logits(logits, sampling, ctx.temperature)  # [S, V]
    return inverse_cdf(u[:, i], jnp.exp(lp)), lp

  x, lp = draw(logits, 0)

  def body(c, i):
    carry, x = c
    carry, logits = step(carry, x, i)
    nxt, lp = draw(logits, i)
    return (carry, nxt), (nxt, lp)

  (carry, _), (xs, lps) = jax.lax.scan(body, (carry, x), jnp.arange(1, num_draft))
  drafts = jnp.concatenate([x[:, None], xs.T], axis=1)  # [S, k]
  logprobs = jnp.concatenate([lp[:, None], lps.transpose(1, 0, 2)], axis=1)  # [S, k, V]
  return drafts, logprobs, carry
