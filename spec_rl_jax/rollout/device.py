"""The engine's device side: pure, jitted state transitions of `SlotState` (no host logic).

Shape legend: ``S`` slots, ``S_c`` slots one decode call runs, ``T`` prefill bucket
length, ``n`` prefill batch bucket, ``M`` max pages per slot, ``M_c`` page-table
columns one decode call reads, ``N`` max new tokens, ``k`` the call's draft length,
``K_max`` its maximum, ``V`` vocab, ``Lh`` history length, ``h`` hidden layers the
proposer declared, ``D`` model dim.

Programs (the state is donated, so the KV pools update in place; output shardings are
fixed, so the state round-trips without recompiling):

  ``prefill``    runs ``n`` left-padded prompts through the policy (and the proposer's
                 prefill, with the prompts' hidden states), samples each first token
                 and inserts the requests into their slots.        one per ``(n, T)``
  ``decode``     a ``lax.while_loop`` of rounds over the first ``S_c`` slots and their
                 first ``M_c`` page-table columns. A round proposes ``k`` drafts (none
                 when ``k = 0``), verifies ``k + 1`` positions in one policy forward
                 (returning the declared hidden states), runs the exact rejection
                 sampler (spec/verifier.py), emits 1..k+1 tokens per slot and calls the
                 proposer's ``observe``. Rejected positions are rolled back by length
                 bookkeeping only. The loop stops when a slot finishes and requests wait,
                 when a slot has no KV room for its next round, when few enough slots
                 are active for a smaller slot bucket (``shrink_at``), or after
                 ``max_rounds``.                                one per ``(k, S_c, M_c)``
  ``resync``     re-prefills the proposer's state from the slots' histories (after
                 calls with ``k = 0``, for proposers that keep a KV cache).
                                                                   one per ``(n, T)``
  ``take_out`` / ``put_back`` / ``recompute``   preemption: a slot's row and pages to the
                 host, and back into fresh pages (or re-prefilled).
  ``move_rows``  compaction: running rows into lower free slots (pages stay put; the
                 page table follows the sequence).
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from spec_rl_jax import sharding
from spec_rl_jax.models import transformer
from spec_rl_jax.models.config import ModelConfig
from spec_rl_jax.rollout.paged_cache import PagedKVCache, gather_pages, scatter_pages
from spec_rl_jax.rollout.types import EngineConfig
from spec_rl_jax.spec.proposers.base import (DraftContext, Feedback, PrefillBatch, Proposer,
                                             ProposerState)
from spec_rl_jax.spec.verifier import verify

RUNNING, EOS, LENGTH = range(3)


@struct.dataclass
class SlotState:
  """Everything the device loop carries. ``[S]`` arrays unless noted."""

  cache: PagedKVCache
  proposer: ProposerState  # the proposer's pools (shared page table) and per-slot rows
  active: jax.Array  # bool: slot holds a request that is still generating
  length: jax.Array  # int32: tokens already in the KV cache
  last: jax.Array  # int32: newest token, at position ``length``, KV not yet written
  rid: jax.Array  # int32: request id (RNG stream)
  group: jax.Array  # int32: prompt-group id (-1 none)
  num_gen: jax.Array  # int32: tokens generated so far
  max_new: jax.Array  # int32: this request's cap
  temperature: jax.Array  # fp32: this request's sampling temperature (0: greedy)
  finish: jax.Array  # int32: RUNNING | EOS | LENGTH
  capacity: jax.Array  # int32: KV positions the slot's pages hold (set by the host)
  history: jax.Array  # [S, Lh] int32: prompt + generated tokens by position
  out_tok: jax.Array  # [S, N] int32
  out_lp: jax.Array  # [S, N] fp32, processed-distribution logprobs
  out_policy_lp: jax.Array  # [S, N] fp32, raw-policy logprobs
  counters: jax.Array  # [4] int32: slot-rounds, drafted, accepted, speculative slot-rounds
  accepted_at: jax.Array  # [K_max] int32: accepted count per draft position


# The per-slot fields a preempted or moved sequence takes with it (with the proposer's
# rows; ``capacity`` is the host's).
ROW_FIELDS = ("active", "length", "last", "rid", "group", "num_gen", "max_new",
              "temperature", "finish", "history", "out_tok", "out_lp", "out_policy_lp")
SLOT_FIELDS = (*ROW_FIELDS, "capacity")  # every [S, ...] field besides the page table


def round_keys(key: jax.Array, rid: jax.Array, pos: jax.Array) -> jax.Array:
  """Per-slot verifier keys: one stream per ``(request id, position)``."""
  return jax.vmap(lambda r, p: jax.random.fold_in(jax.random.fold_in(key, r), p))(rid, pos)


def _rows_at(rows, idx):
  return jax.tree.map(lambda x: x[idx], rows)


def _set_rows(rows, idx, values):
  return jax.tree.map(lambda x, v: x.at[idx].set(v, mode="drop"), rows, values)


class DevicePrograms:
  """The jitted programs of one engine (see the module docstring).

  ``weights`` / ``draft_weights`` (`transformer.Weights`, never donated) are passed to
  every call; the state is donated and returned.
  """

  def __init__(self, graphdef: nnx.GraphDef, model_config: ModelConfig, config: EngineConfig,
               proposer: Proposer | None, mesh: Mesh, compiler_options):
    self.graphdef, self.model_config, self.config = graphdef, model_config, config
    self.proposer = proposer
    self.hidden_layers = tuple(proposer.hidden_layers) if proposer is not None else ()
    self.history_len = config.max_seq_len + config.max_draft_tokens + 1  # Lh
    self.state_sharding = self._state_shardings(mesh)
    sh, opts = self.state_sharding, compiler_options
    self.prefill = jax.jit(self._prefill_insert, donate_argnums=2, out_shardings=sh,
                           compiler_options=opts)
    self.recompute = jax.jit(self._recompute_insert, donate_argnums=2, out_shardings=sh,
                             compiler_options=opts)
    self.resync = jax.jit(self._resync, donate_argnums=2, static_argnames="T", out_shardings=sh,
                          compiler_options=opts)
    self.take_out = jax.jit(self._take_out, donate_argnums=0)
    self.put_back = jax.jit(self._put_back, donate_argnums=0, out_shardings=sh)
    self.move_rows = jax.jit(self._move_rows, donate_argnums=0, out_shardings=sh)
    self.decode = jax.jit(self._decode, donate_argnums=2,
                          static_argnames=("k", "slots", "pages"),
                          out_shardings=(sh, NamedSharding(mesh, P())), compiler_options=opts)

  # ---------------------------------------------------------------- state

  def init_state(self) -> SlotState:
    c, S, N = self.config, self.config.num_slots, self.config.max_new_tokens
    ints = lambda *shape: jnp.zeros(shape or (S,), jnp.int32)  # distinct buffers (donated)
    proposer = (ProposerState() if self.proposer is None
                else self.proposer.init_state(c))
    return SlotState(
        cache=PagedKVCache.init(self.model_config, S, c.num_pages, c.page_size,
                                c.max_pages_per_slot),
        proposer=proposer,
        active=jnp.zeros((S,), bool), length=ints(), last=ints(), rid=ints(),
        group=jnp.full((S,), -1, jnp.int32), num_gen=ints(), max_new=ints(),
        temperature=jnp.zeros((S,), jnp.float32), finish=ints(),
        capacity=ints(), history=ints(S, self.history_len),
        out_tok=ints(S, N), out_lp=jnp.zeros((S, N), jnp.float32),
        out_policy_lp=jnp.zeros((S, N), jnp.float32), counters=ints(4),
        accepted_at=ints(max(c.max_draft_tokens, 1)))

  def _state_shardings(self, mesh: Mesh) -> SlotState:
    """Page pools (policy and proposer alike) split over KV heads (``tensor``) by the
    logical rules; slot bookkeeping replicated."""
    shape = dict(zip(mesh.axis_names, mesh.axis_sizes))
    abstract = jax.eval_shape(self.init_state)

    def one(x):
      axes = (None,) * x.ndim
      if x.ndim >= 4:  # [L, Hk, P, (Ps,) Dh]
        axes = ("layers", "act_kv_heads") + (None,) * (x.ndim - 2)
      return NamedSharding(mesh, sharding.logical_to_spec(axes, x.shape, shape))

    return jax.tree.map(one, abstract)

  def initial_state(self) -> SlotState:
    return jax.device_put(self.init_state(), self.state_sharding)

  # ---------------------------------------------------------------- prefill

  def _write_tokens(self, weights, draft_weights, state: SlotState, slots, tokens, lens,
                    pages, *, policy: bool = True):
    """Writes ``tokens[n, T]`` (left-padded, real lengths ``lens[n]``) into ``pages[n, M]``
    of the policy's cache (``policy``) and the proposer's state. Returns ``(logits of the
    last token [n, 1, V] or None, cache, proposer state)``; rows with ``lens = 0``
    write nothing."""
    n, T = tokens.shape
    positions = lens[:, None] - T + jnp.arange(T)[None, :]  # pads < 0
    logits, cache, hidden = None, state.cache, None
    if policy or self.hidden_layers:
      out = transformer.apply(self.graphdef, weights, tokens, positions,
                              cache=state.cache.replace(page_table=pages),
                              logits_at=jnp.full((n, 1), T - 1),
                              hidden_layers=self.hidden_layers)
      logits, hidden = out.logits, out.hidden
      # Rewriting positions the policy already holds stores the same values.
      cache = out.cache.replace(page_table=state.cache.page_table)
    proposer_state = state.proposer
    if self.proposer is not None:
      proposer_state = self.proposer.prefill(
          draft_weights, proposer_state, PrefillBatch(slots, tokens, positions, pages, hidden,
                                                        weights))
    return logits, cache, proposer_state

  def _prefill_insert(self, weights, draft_weights, state: SlotState, key, slots, tokens,
                      lens, pages, rids, groups, rows, max_new, temperature):
    """Prefills ``tokens[n, T]`` into ``slots[n]``, samples each first token at the
    requests' ``temperature[n]``.

    Padding entries carry ``slots = S`` (dropped) and ``lens = 0`` (nothing written);
    ``rows`` are the proposer's per-slot rows of the requests (`Proposer.request_rows`).
    """
    # The request's rows first: the proposer's prefill may write into them.
    state = state.replace(proposer=state.proposer.replace(
        rows=_set_rows(state.proposer.rows, slots, rows)))
    logits, cache, proposer_state = self._write_tokens(weights, draft_weights, state, slots,
                                                       tokens, lens, pages)
    n, T = tokens.shape
    first = verify(round_keys(key, rids, lens), jnp.zeros((n, 0), jnp.int32), None,
                   logits, self.config.sampling, temperature)
    tok = first.tokens[:, 0]
    eos = jnp.asarray(self.config.eos_ids, jnp.int32)
    finish = jnp.where(jnp.isin(tok, eos), EOS, jnp.where(max_new <= 1, LENGTH, RUNNING))
    # history row: the prompt at positions 0..len-1, the first token at len
    j = jnp.arange(self.history_len)[None, :]
    hist = jnp.take_along_axis(tokens, jnp.clip(T - lens[:, None] + j, 0, T - 1), axis=1)
    hist = jnp.where(j < lens[:, None], hist, jnp.where(j == lens[:, None], tok[:, None], 0))
    put = lambda a, v: a.at[slots].set(v, mode="drop")
    return state.replace(
        cache=cache, proposer=proposer_state,
        active=put(state.active, finish == RUNNING), length=put(state.length, lens),
        last=put(state.last, tok), rid=put(state.rid, rids), group=put(state.group, groups),
        num_gen=put(state.num_gen, jnp.ones_like(lens)), max_new=put(state.max_new, max_new),
        temperature=put(state.temperature, temperature),
        finish=put(state.finish, finish), history=put(state.history, hist),
        out_tok=state.out_tok.at[slots, 0].set(tok, mode="drop"),
        out_lp=state.out_lp.at[slots, 0].set(first.logprobs[:, 0], mode="drop"),
        out_policy_lp=state.out_policy_lp.at[slots, 0].set(first.policy_logprobs[:, 0],
                                                            mode="drop"))

  def _history_tokens(self, state: SlotState, slots, T: int):
    """The first ``length`` history tokens of ``slots[n]`` right-aligned in ``[n, T]``
    (``S``: padding, length 0), with the slots' lengths and page-table rows."""
    S = state.active.shape[0]
    ok = slots < S
    s = jnp.minimum(slots, S - 1)
    lens = jnp.where(ok, state.length[s], 0)
    idx = lens[:, None] - T + jnp.arange(T)[None, :]
    tokens = jnp.take_along_axis(state.history[s], jnp.maximum(idx, 0), axis=1)
    return jnp.where(idx >= 0, tokens, 0), lens, state.cache.page_table[s]

  def _resync(self, weights, draft_weights, state: SlotState, slots, *, T: int):
    """Re-prefills the proposer's state of ``slots[n]`` over their ``length`` tokens (the
    policy's cache is rewritten with identical values only when the proposer needs its
    hidden states)."""
    tokens, lens, pages = self._history_tokens(state, slots, T)
    _, cache, proposer_state = self._write_tokens(weights, draft_weights, state, slots,
                                                  tokens, lens, pages, policy=False)
    return state.replace(cache=cache, proposer=proposer_state)

  def _recompute_insert(self, weights, draft_weights, state: SlotState, slot, tokens, lens,
                        pages, row) -> SlotState:
    """Restores a dropped sequence: its row, then a re-prefill of its ``lens`` tokens
    (which rewrites the proposer's rows from the sequence, as at admission)."""
    state = self._set_row(state, slot, row)
    _, cache, proposer_state = self._write_tokens(weights, draft_weights, state, slot[None],
                                                  tokens, lens, pages)
    return state.replace(cache=cache, proposer=proposer_state)

  # ---------------------------------------------------------------- preemption

  def _take_out(self, state: SlotState, slot, ids):
    """``(state with the slot idle, slot row, contents of pages ids [n])``."""
    row = {f: getattr(state, f)[slot] for f in ROW_FIELDS}
    row["proposer_rows"] = _rows_at(state.proposer.rows, slot)
    pools = gather_pages((state.cache.layers, state.proposer.pools), ids)
    return state.replace(active=state.active.at[slot].set(False)), row, pools

  def _set_row(self, state: SlotState, slot, row) -> SlotState:
    proposer = state.proposer.replace(
        rows=_set_rows(state.proposer.rows, slot, row["proposer_rows"]))
    return state.replace(proposer=proposer,
                         **{f: getattr(state, f).at[slot].set(row[f]) for f in ROW_FIELDS})

  def _put_back(self, state: SlotState, slot, ids, row, pools) -> SlotState:
    """Restores an offloaded sequence: its pages into ``ids`` (pads dropped), its row."""
    layers, proposer_pools = scatter_pages((state.cache.layers, state.proposer.pools), ids,
                                           pools)
    state = state.replace(cache=state.cache.replace(layers=layers),
                          proposer=state.proposer.replace(pools=proposer_pools))
    return self._set_row(state, slot, row)

  def _move_rows(self, state: SlotState, src, dst) -> SlotState:
    """Moves the rows of slots ``src[n]`` to free slots ``dst[n]`` (pads: ``dst = S``,
    dropped); the vacated slots become idle and groupless (no n-gram sibling)."""
    rows = {f: getattr(state, f)[src] for f in ROW_FIELDS}
    prow = _rows_at(state.proposer.rows, src)
    state = state.replace(active=state.active.at[src].set(False, mode="drop"),
                          group=state.group.at[src].set(-1, mode="drop"))
    proposer = state.proposer.replace(rows=_set_rows(state.proposer.rows, dst, prow))
    return state.replace(proposer=proposer,
                         **{f: getattr(state, f).at[dst].set(rows[f], mode="drop")
                            for f in ROW_FIELDS})

  # ---------------------------------------------------------------- rounds

  def _round(self, weights, draft_weights, st: SlotState, key, k: int):
    """One round: propose ``k``, verify ``k + 1``, emit 1..k+1 tokens per active slot."""
    S, N = st.out_tok.shape
    act = st.active
    proposer_state = st.proposer
    drafts, draft_lp = jnp.zeros((S, 0), jnp.int32), None
    if k:
      ctx = DraftContext(last=st.last, length=st.length, active=act, rid=st.rid,
                         group=st.group, history=st.history, page_table=st.cache.page_table,
                         key=key, temperature=st.temperature, target_weights=weights,
                         cache=st.cache)
      drafts, draft_lp, proposer_state = self.proposer.propose(
          draft_weights, proposer_state, ctx, k, self.config.sampling)
    inputs = jnp.concatenate([st.last[:, None], drafts], 1)  # [S, k+1]
    positions = jnp.where(act[:, None], st.length[:, None] + jnp.arange(k + 1)[None, :], -1)
    out = transformer.apply(self.graphdef, weights, inputs, positions, cache=st.cache,
                            hidden_layers=self.hidden_layers if k else ())
    v = verify(round_keys(key, st.rid, st.length + 1), drafts, draft_lp, out.logits,
               self.config.sampling, st.temperature)

    # Truncate at the first EOS and at the request's cap.
    i = jnp.arange(k + 1)[None, :]
    eos = jnp.asarray(self.config.eos_ids, jnp.int32)
    is_eos = jnp.isin(v.tokens, eos) & (i < v.num_emitted[:, None])
    first_eos = jnp.where(jnp.any(is_eos, 1), jnp.argmax(is_eos, 1) + 1, k + 1)
    n = jnp.minimum(jnp.minimum(v.num_emitted, first_eos), st.max_new - st.num_gen)
    n = jnp.where(act, n, 0)  # [S] tokens emitted this round
    if k:
      proposer_state = self.proposer.observe(
          draft_weights, proposer_state,
          Feedback(inputs, positions, v.tokens, n, out.hidden, st.cache.page_table,
                   weights))
    keep = i < n[:, None]
    rows = jnp.arange(S)[:, None]
    col = jnp.where(keep, st.num_gen[:, None] + i, N)  # N: dropped
    hpos = jnp.where(keep, st.length[:, None] + 1 + i, self.history_len)
    num_gen = st.num_gen + n
    hit_eos = jnp.any(is_eos & keep, 1)
    finish = jnp.where(act, jnp.where(hit_eos, EOS, jnp.where(num_gen >= st.max_new, LENGTH,
                                                               RUNNING)), st.finish)
    last = jnp.take_along_axis(v.tokens, jnp.maximum(n - 1, 0)[:, None], 1)[:, 0]
    accepted = v.accepted & act[:, None]
    busy = act.sum()
    st = st.replace(
        cache=out.cache, proposer=proposer_state, active=act & (finish == RUNNING),
        length=st.length + n, last=jnp.where(act, last, st.last), num_gen=num_gen,
        finish=finish,
        history=st.history.at[rows, hpos].set(v.tokens, mode="drop"),
        out_tok=st.out_tok.at[rows, col].set(v.tokens, mode="drop"),
        out_lp=st.out_lp.at[rows, col].set(v.logprobs, mode="drop"),
        out_policy_lp=st.out_policy_lp.at[rows, col].set(v.policy_logprobs, mode="drop"),
        counters=st.counters + jnp.stack([busy, k * busy, accepted.sum(),
                                          busy if k else jnp.zeros_like(busy)]),
        accepted_at=st.accepted_at.at[:k].add(accepted.sum(0)))
    return st, jnp.any(act & ~st.active)

  @staticmethod
  def _narrow(state: SlotState, slots: int, pages: int) -> SlotState:
    """The first ``slots`` rows of ``state`` and their first ``pages`` page-table columns."""
    return state.replace(
        **{f: getattr(state, f)[:slots] for f in SLOT_FIELDS},
        proposer=state.proposer.replace(rows=_rows_at(state.proposer.rows, slice(0, slots))),
        cache=state.cache.replace(page_table=state.cache.page_table[:slots, :pages]))

  @staticmethod
  def _widen(full: SlotState, state: SlotState) -> SlotState:
    """``state``, narrowed from ``full`` by `_narrow`, with ``full``'s shapes again."""
    slots = state.active.shape[0]
    rows = jax.tree.map(lambda f, x: f.at[:slots].set(x), full.proposer.rows,
                        state.proposer.rows)
    return state.replace(
        **{f: getattr(full, f).at[:slots].set(getattr(state, f)) for f in SLOT_FIELDS},
        proposer=state.proposer.replace(rows=rows),
        cache=state.cache.replace(page_table=full.cache.page_table))

  def _decode(self, weights, draft_weights, state: SlotState, key, stop_on_finish,
              max_rounds, shrink_at, *, k: int, slots: int, pages: int):
    """Runs up to ``max_rounds`` rounds of draft length ``k``; returns ``(state, rounds)``.
    The loop also stops once at most ``shrink_at`` slots are active (the host then runs
    the rest in a smaller slot bucket, and may choose another ``k``).

    The rounds see the first ``slots`` (``S_c``) slots and their first ``pages``
    (``M_c``) page-table columns only: attention then reads ``S_c * M_c`` pages per
    layer instead of ``S * M``. The host passes ``S_c`` above every running slot and
    ``M_c >= capacity / Ps`` of every slot, and the loop stops before a slot outgrows
    its capacity, so every row and position a call touches lies inside.
    """
    full, state = state, self._narrow(state, slots, pages)
    room = k + 1  # KV positions one round writes

    def cond(carry):
      rounds, st, finished = carry
      needs_pages = jnp.any(st.active & (st.length + room > st.capacity))
      return ((rounds < max_rounds) & (st.active.sum() > shrink_at)
              & ~(stop_on_finish & finished) & ~needs_pages)

    def body(carry):
      rounds, st, finished = carry
      st, newly = self._round(weights, draft_weights, st, key, k)
      return rounds + 1, st, finished | newly

    rounds, state, _ = jax.lax.while_loop(cond, body, (jnp.int32(0), state, jnp.bool_(False)))
    return self._widen(full, state), rounds
