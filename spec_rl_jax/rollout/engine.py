"""The slot engine: batched prefill/insert, a device-side decode loop, continuous batching.

Shape legend: ``S`` slots, ``T`` prefill bucket length, ``n`` prefill batch bucket,
``M`` max pages per slot, ``N`` max new tokens, ``V`` vocab.

Device side (jitted, state donated so the KV pools update in place):
  * ``_prefill_insert``: runs ``n`` left-padded prompts through the model, writing their
    KV into freshly allocated pages, samples each first token and inserts the requests
    into their slots.
  * ``_decode``: a ``lax.while_loop`` of rounds over all slots; returns to the host when
    a slot finishes and requests are waiting, when every slot is idle, or after
    ``round_budget`` rounds.
Host side (`RolloutEngine.generate`): a FIFO queue, page allocation against the KV
budget (admission waits when pages run short), refilling free slots between device
calls, and collecting finished responses.

Sampling randomness is keyed by ``(seed, request_id, position)``, so a response does not
depend on the slot or the batch it ran in (callers give fresh request ids, or a new
seed, when they want fresh samples).
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct
from jax.sharding import NamedSharding, PartitionSpec as P

from spec_rl_jax import sharding
from spec_rl_jax.models.tokenizer import Tokenizer, check_vocab
from spec_rl_jax.models.transformer import Decoder
from spec_rl_jax.rollout.paged_cache import PagedKVCache, PagePool
from spec_rl_jax.rollout.types import FINISH_REASONS, EngineConfig, Request, Response
from spec_rl_jax.sampling import process_logits

RUNNING, EOS, LENGTH = range(3)


@struct.dataclass
class SlotState:
  """Everything the device loop carries. ``[S]`` arrays unless noted."""

  cache: PagedKVCache
  active: jax.Array  # bool: slot holds a request that is still generating
  length: jax.Array  # int32: tokens already in the KV cache
  last: jax.Array  # int32: last sampled token (its KV is written next round)
  rid: jax.Array  # int32: request id (RNG stream)
  num_gen: jax.Array  # int32: tokens generated so far
  max_new: jax.Array  # int32: this request's cap
  finish: jax.Array  # int32: RUNNING | EOS | LENGTH
  out_tok: jax.Array  # [S, N] int32
  out_lp: jax.Array  # [S, N] fp32, processed-distribution logprobs
  out_policy_lp: jax.Array  # [S, N] fp32, raw-policy logprobs


def sample_tokens(key: jax.Array, logits: jax.Array, rid: jax.Array, pos: jax.Array,
                  cfg: EngineConfig):
  """Samples ``[S]`` tokens from ``logits[S, V]``; the token will sit at ``pos[S]``.

  Returns ``(tokens, processed logprobs, raw-policy logprobs)``, each ``[S]``.
  """
  policy_lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  lp = process_logits(logits, cfg.sampling)
  keys = jax.vmap(lambda r, p: jax.random.fold_in(jax.random.fold_in(key, r), p))(rid, pos)
  tok = jax.vmap(jax.random.categorical)(keys, lp)
  pick = lambda a: jnp.take_along_axis(a, tok[:, None], axis=-1)[:, 0]
  return tok.astype(jnp.int32), pick(lp), pick(policy_lp)


def _finish_code(tok, num_gen, max_new, eos):
  return jnp.where(jnp.isin(tok, eos), EOS, jnp.where(num_gen >= max_new, LENGTH, RUNNING))


class RolloutEngine:
  """Continuous-batching generation over a paged KV cache.

  ``engine.generate(requests)`` returns one `Response` per request, in order. Swap the
  policy weights with `update_params` (same shapes: nothing recompiles).
  """

  def __init__(self, model: Decoder, config: EngineConfig, tokenizer: Tokenizer | None = None):
    self.config = config
    self.model_config = model.cfg
    self.tokenizer = tokenizer
    if tokenizer is not None:
      check_vocab(tokenizer, model.cfg.vocab_size)
    self._graphdef, self._params = nnx.split(model)
    self._pool = PagePool(config.num_pages, config.page_size)
    leaf = jax.tree.leaves(self._params)[0]
    mesh = (leaf.sharding.mesh if isinstance(leaf.sharding, NamedSharding)
            else sharding.make_mesh((1, 1, 1)))
    state_sharding = self._state_shardings(mesh)
    self._state = jax.device_put(self._init_state(), state_sharding)
    self._key = jax.random.key(config.seed)
    # Fixed output shardings: the state round-trips through both functions unchanged,
    # so neither recompiles after the first call.
    self._prefill_fn = jax.jit(self._prefill_insert, donate_argnums=1,
                               out_shardings=state_sharding)
    self._decode_fn = jax.jit(self._decode, donate_argnums=1,
                              out_shardings=(state_sharding, NamedSharding(mesh, P())))
    self.stats = collections.Counter()

  # ------------------------------------------------------------------ device side

  def _init_state(self) -> SlotState:
    c, S, N = self.config, self.config.num_slots, self.config.max_new_tokens
    zeros = lambda: jnp.zeros((S,), jnp.int32)  # distinct buffers: the state is donated
    return SlotState(
        cache=PagedKVCache.init(self.model_config, S, c.num_pages, c.page_size,
                                c.max_pages_per_slot),
        active=jnp.zeros((S,), bool), length=zeros(), last=zeros(), rid=zeros(),
        num_gen=zeros(), max_new=zeros(), finish=zeros(), out_tok=jnp.zeros((S, N), jnp.int32),
        out_lp=jnp.zeros((S, N), jnp.float32), out_policy_lp=jnp.zeros((S, N), jnp.float32))

  def _state_shardings(self, mesh) -> SlotState:
    """KV pools split over KV heads (``tensor``); slot bookkeeping replicated."""
    shape = dict(zip(mesh.axis_names, mesh.axis_sizes))
    abstract = jax.eval_shape(self._init_state)

    def one(x):
      axes = (None,) * x.ndim
      if x.ndim >= 4:  # [L, Hk, P, (Ps,) Dh]
        axes = ("layers", "act_kv_heads") + (None,) * (x.ndim - 2)
      return NamedSharding(mesh, sharding.logical_to_spec(axes, x.shape, shape))

    return jax.tree.map(one, abstract)

  def _prefill_insert(self, params, state: SlotState, key, slots, tokens, lens, pages, rids,
                      max_new):
    """Prefills ``tokens[n, T]`` (left-padded, real lengths ``lens[n]``) into ``slots[n]``.

    Padding entries carry ``slots = S`` (dropped) and ``lens = 0`` (nothing written).
    """
    model = nnx.merge(self._graphdef, params)
    n, T = tokens.shape
    positions = lens[:, None] - T + jnp.arange(T)[None, :]  # pads < 0
    view = state.cache.replace(page_table=pages)
    out = model(tokens, positions, cache=view, logits_at=jnp.full((n, 1), T - 1))
    tok, lp, policy_lp = sample_tokens(key, out.logits[:, 0], rids, lens, self.config)
    eos = jnp.asarray(self.config.eos_ids, jnp.int32)
    finish = _finish_code(tok, jnp.ones_like(lens), max_new, eos)
    put = lambda a, v: a.at[slots].set(v, mode="drop")
    return state.replace(
        cache=out.cache.replace(page_table=put(state.cache.page_table, pages)),
        active=put(state.active, finish == RUNNING), length=put(state.length, lens),
        last=put(state.last, tok), rid=put(state.rid, rids),
        num_gen=put(state.num_gen, jnp.ones_like(lens)), max_new=put(state.max_new, max_new),
        finish=put(state.finish, finish),
        out_tok=state.out_tok.at[slots, 0].set(tok, mode="drop"),
        out_lp=state.out_lp.at[slots, 0].set(lp, mode="drop"),
        out_policy_lp=state.out_policy_lp.at[slots, 0].set(policy_lp, mode="drop"))

  def _decode(self, params, state: SlotState, key, stop_on_finish, max_rounds):
    """Runs up to ``max_rounds`` AR rounds; returns ``(state, rounds run)``."""
    model = nnx.merge(self._graphdef, params)
    S, N = state.out_tok.shape
    eos = jnp.asarray(self.config.eos_ids, jnp.int32)

    def cond(carry):
      rounds, st, finished = carry
      return (rounds < max_rounds) & jnp.any(st.active) & ~(stop_on_finish & finished)

    def body(carry):
      rounds, st, finished = carry
      act = st.active
      positions = jnp.where(act, st.length, -1)[:, None]
      out = model(st.last[:, None], positions, cache=st.cache)
      tok, lp, policy_lp = sample_tokens(key, out.logits[:, 0], st.rid, st.length + 1,
                                         self.config)
      col = jnp.where(act, st.num_gen, N)  # N: dropped
      rows = jnp.arange(S)
      num_gen = st.num_gen + act
      finish = jnp.where(act, _finish_code(tok, num_gen, st.max_new, eos), st.finish)
      active = act & (finish == RUNNING)
      st = st.replace(
          cache=out.cache, active=active, length=st.length + act,
          last=jnp.where(act, tok, st.last), num_gen=num_gen, finish=finish,
          out_tok=st.out_tok.at[rows, col].set(tok, mode="drop"),
          out_lp=st.out_lp.at[rows, col].set(lp, mode="drop"),
          out_policy_lp=st.out_policy_lp.at[rows, col].set(policy_lp, mode="drop"))
      return rounds + 1, st, finished | jnp.any(act & ~active)

    rounds, state, _ = jax.lax.while_loop(cond, body, (jnp.int32(0), state, jnp.bool_(False)))
    return state, rounds

  # ------------------------------------------------------------------ host side

  def update_params(self, model: Decoder) -> None:
    """Uses ``model``'s weights for the next rollouts (same config required)."""
    if model.cfg != self.model_config:
      raise ValueError("update_params needs a model with the engine's ModelConfig")
    self._params = nnx.state(model)

  def _bucket_len(self, n: int) -> int:
    b = self.config.min_prefill_len
    while b < n:
      b *= 2
    return min(b, self.config.max_seq_len)

  def _bucket_batch(self, n: int) -> int:
    b = 1
    while b < n:
      b *= 2
    return min(b, self.config.num_slots)

  def _validate(self, requests: Sequence[Request]) -> None:
    c = self.config
    ids = [r.request_id for r in requests]
    if len(set(ids)) != len(ids):
      raise ValueError("request_id values must be unique within a generate call")
    for r in requests:
      max_new = c.max_new_tokens if r.max_new_tokens is None else r.max_new_tokens
      if not r.prompt:
        raise ValueError(f"request {r.request_id}: empty prompt")
      if not 1 <= max_new <= c.max_new_tokens:
        raise ValueError(f"request {r.request_id}: max_new_tokens={max_new} outside"
                         f" [1, {c.max_new_tokens}] (EngineConfig.max_new_tokens)")
      total = len(r.prompt) + max_new
      if total > c.max_seq_len:
        raise ValueError(f"request {r.request_id}: prompt ({len(r.prompt)} tokens) +"
                         f" max_new_tokens ({max_new}) = {total} exceeds max_seq_len"
                         f" {c.max_seq_len}")
      need = self._pool.pages_for(total)
      if need > c.num_pages:
        raise ValueError(f"request {r.request_id} needs {need} KV pages but the budget is"
                         f" {c.num_pages} pages (EngineConfig.num_pages): it can never fit")
      if max(r.prompt) >= self.model_config.vocab_size or min(r.prompt) < 0:
        raise ValueError(f"request {r.request_id}: token id outside [0,"
                         f" {self.model_config.vocab_size})")

  def generate(self, requests: Sequence[Request]) -> list[Response]:
    """Completes every request (continuous batching); responses in request order."""
    self._validate(requests)
    c, S, M = self.config, self.config.num_slots, self.config.max_pages_per_slot
    queue = collections.deque(requests)
    free_slots = list(range(S - 1, -1, -1))
    running: dict[int, tuple[Request, list[int]]] = {}  # slot -> (request, pages)
    done: dict[int, Response] = {}

    while queue or running:
      admitted = []
      while queue and free_slots:
        r = queue[0]
        max_new = c.max_new_tokens if r.max_new_tokens is None else r.max_new_tokens
        need = self._pool.pages_for(len(r.prompt) + max_new)
        if need > self._pool.num_free:
          self.stats["admission_waits"] += 1
          break  # FIFO: wait for pages rather than skip ahead
        queue.popleft()
        slot = free_slots.pop()
        running[slot] = (r, self._pool.allocate(need))
        admitted.append((slot, max_new))
      if admitted:
        self._state = self._prefill(admitted, running)
      self._state, rounds = self._decode_fn(self._params, self._state, self._key,
                                            jnp.bool_(bool(queue)), jnp.int32(c.round_budget))
      self.stats["device_calls"] += 1
      self.stats["rounds"] += int(rounds)
      finish = np.asarray(self._state.finish)
      finished = [s for s in running if finish[s] != RUNNING]
      if finished:
        self._collect(finished, running, done, free_slots)
    return [done[r.request_id] for r in requests]

  def _prefill(self, admitted, running) -> SlotState:
    c, S = self.config, self.config.num_slots
    n = self._bucket_batch(len(admitted))
    T = self._bucket_len(max(len(running[s][0].prompt) for s, _ in admitted))
    slots = np.full((n,), S, np.int32)
    tokens = np.zeros((n, T), np.int32)
    lens = np.zeros((n,), np.int32)
    pages = np.zeros((n, c.max_pages_per_slot), np.int32)
    rids = np.zeros((n,), np.int32)
    max_new = np.ones((n,), np.int32)
    for i, (slot, mn) in enumerate(admitted):
      r, pg = running[slot]
      slots[i], lens[i], rids[i], max_new[i] = slot, len(r.prompt), r.request_id, mn
      tokens[i, T - len(r.prompt):] = r.prompt
      pages[i, :len(pg)] = pg
    self.stats["prefills"] += 1
    return self._prefill_fn(self._params, self._state, self._key, *map(jnp.asarray, (
        slots, tokens, lens, pages, rids, max_new)))

  def _collect(self, finished, running, done, free_slots) -> None:
    st = self._state
    num_gen, finish = np.asarray(st.num_gen), np.asarray(st.finish)
    toks, lps, plps = jax.device_get((st.out_tok, st.out_lp, st.out_policy_lp))
    for s in finished:
      r, pages = running.pop(s)
      n = int(num_gen[s])
      done[r.request_id] = Response(
          request_id=r.request_id, prompt=list(r.prompt), tokens=toks[s, :n].tolist(),
          logprobs=lps[s, :n].copy(), policy_logprobs=plps[s, :n].copy(),
          finish_reason=FINISH_REASONS[int(finish[s])])
      self._pool.release(pages)
      free_slots.append(s)  # its stale ``finish`` is ignored until prefill reuses it

  # ------------------------------------------------------------------ text API

  def generate_text(self, prompts: Sequence[str], max_new_tokens: int | None = None,
                    first_request_id: int = 0) -> list[tuple[str, Response]]:
    """Encodes ``prompts`` with the engine's tokenizer, generates, decodes."""
    if self.tokenizer is None:
      raise ValueError("generate_text needs an engine built with a tokenizer")
    reqs = [Request(self.tokenizer.encode(p), first_request_id + i, max_new_tokens)
            for i, p in enumerate(prompts)]
    return [(self.tokenizer.decode(r.tokens), r) for r in self.generate(reqs)]
