"""The slot engine: batched prefill/insert, a device-side loop of rounds, continuous
batching, speculative rounds.

Shape legend: ``S`` slots, ``S_c`` slots one decode call runs, ``T`` prefill bucket
length, ``n`` prefill batch bucket, ``M`` max pages per slot, ``M_c`` page-table
columns one decode call reads, ``N`` max new tokens, ``K`` draft tokens, ``V`` vocab,
``Lh`` history length, ``R`` reference length.

Device side (jitted, state donated so the KV pools update in place):
  * ``_prefill_insert``: runs ``n`` left-padded prompts through the model, writing their
    KV into freshly allocated pages, samples each first token and inserts the requests
    into their slots (the proposer sees the prompts too).
  * ``_decode``: a ``lax.while_loop`` of rounds over all slots. A round proposes ``K``
    drafts (none when ``K = 0``), verifies ``K + 1`` positions in one target forward
    and runs the exact rejection sampler (spec/verifier.py), emitting 1..K+1 tokens per
    slot. Rejected positions are rolled back by length bookkeeping only. The loop
    returns to the host when a slot finishes and requests are waiting, when a slot has
    no KV room for its next round, when every slot is idle, or after ``round_budget``
    rounds. A call runs the first ``S_c`` slots only and reads their first ``M_c``
    page-table columns (static buckets, `_call_shape`): the host keeps the
    running sequences in the lowest slots (`Scheduler.compact`), so a batch's long tail
    runs ``S_c`` rows, not ``S``; and no slot can outgrow its pages within a call, so
    the columns past ``M_c`` are unused.
  * ``_take_out`` / ``_put_back`` / ``_recompute_insert``: preemption — a slot's row and
    pages to the host, and back into fresh pages (or re-prefilled).
  * ``_move_rows``: compaction — running sequences' rows into lower free slots (their
    pages stay where they are: the page table follows the sequence).
Host side (`RolloutEngine.generate` with rollout/scheduler.py): a FIFO queue, pages
taken on demand under the KV budget, preemption and restore when it runs short,
refilling free slots between device calls, collecting finished responses, and the
memory of earlier rollouts per prompt (n-gram references).

Sampling randomness is keyed by ``(seed, request_id, position)``, so a response does not
depend on the slot or the batch it ran in (callers give fresh request ids, or a new
seed, when they want fresh samples).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct
from jax.sharding import NamedSharding, PartitionSpec as P

from spec_rl_jax import sharding
from spec_rl_jax.models.tokenizer import Tokenizer, check_vocab
from spec_rl_jax.models import transformer
from spec_rl_jax.models.transformer import Decoder
from spec_rl_jax.rollout.paged_cache import (PagedKVCache, PagePool, gather_pages, page_bytes,
                                              scatter_pages)
from spec_rl_jax.rollout.scheduler import SCHEDULER_STATS, Scheduler, SeqState
from spec_rl_jax.rollout.types import (FINISH_REASONS, EngineConfig, Request, Response,
                                       RolloutResult)
from spec_rl_jax.spec.proposers.base import DraftContext, Proposer
from spec_rl_jax.spec.verifier import verify

RUNNING, EOS, LENGTH = range(3)


@struct.dataclass
class SlotState:
  """Everything the device loop carries. ``[S]`` arrays unless noted."""

  cache: PagedKVCache
  proposer: object  # the proposer's device state (e.g. draft KV pools)
  active: jax.Array  # bool: slot holds a request that is still generating
  length: jax.Array  # int32: tokens already in the KV cache
  last: jax.Array  # int32: newest token, at position ``length``, KV not yet written
  rid: jax.Array  # int32: request id (RNG stream)
  group: jax.Array  # int32: prompt-group id (-1 none)
  num_gen: jax.Array  # int32: tokens generated so far
  max_new: jax.Array  # int32: this request's cap
  finish: jax.Array  # int32: RUNNING | EOS | LENGTH
  capacity: jax.Array  # int32: KV positions the slot's pages hold (set by the host)
  history: jax.Array  # [S, Lh] int32: prompt + generated tokens by position
  reference: jax.Array  # [S, R] int32: earlier rollouts of the prompt, -1 padded
  out_tok: jax.Array  # [S, N] int32
  out_lp: jax.Array  # [S, N] fp32, processed-distribution logprobs
  out_policy_lp: jax.Array  # [S, N] fp32, raw-policy logprobs
  counters: jax.Array  # [3] int32: slot-rounds, drafted tokens, accepted tokens
  accepted_at: jax.Array  # [K] int32: accepted count per draft position


LENGTH_HISTORY = 1024  # latest finished response lengths the scheduler models lengths on

# The per-slot fields a preempted sequence takes with it (``capacity`` is the host's).
ROW_FIELDS = ("active", "length", "last", "rid", "group", "num_gen", "max_new", "finish",
              "history", "reference", "out_tok", "out_lp", "out_policy_lp")
SLOT_FIELDS = (*ROW_FIELDS, "capacity")  # every [S, ...] field besides the page table


def _pow2(n: int) -> int:
  """The smallest power of two ``>= n`` (shape buckets keep compiles few)."""
  b = 1
  while b < n:
    b *= 2
  return b


def round_keys(key: jax.Array, rid: jax.Array, pos: jax.Array) -> jax.Array:
  """Per-slot verifier keys: one stream per ``(request id, position)``."""
  return jax.vmap(lambda r, p: jax.random.fold_in(jax.random.fold_in(key, r), p))(rid, pos)


class RolloutEngine:
  """Continuous-batching (speculative) generation over a paged KV cache.

  ``engine.generate(requests)`` returns a `RolloutResult`: one `Response` per request,
  in order, plus metrics. Swap weights with `update_params` (same shapes: nothing
  recompiles). ``proposer`` drafts ``config.num_draft_tokens`` tokens per round.
  """

  def __init__(self, model: Decoder, config: EngineConfig, tokenizer: Tokenizer | None = None,
               proposer: Proposer | None = None):
    if (config.num_draft_tokens > 0) != (proposer is not None):
      raise ValueError("num_draft_tokens > 0 needs a proposer, and a proposer needs"
                       f" num_draft_tokens > 0 (got K={config.num_draft_tokens})")
    if proposer is not None and getattr(proposer, "vocab_size", model.cfg.vocab_size) \
        != model.cfg.vocab_size:
      raise ValueError(f"proposer vocab_size {proposer.vocab_size} != policy vocab_size"
                       f" {model.cfg.vocab_size}")
    self.config = config
    self.model_config = model.cfg
    self.tokenizer = tokenizer
    self.proposer = proposer
    if tokenizer is not None:
      check_vocab(tokenizer, model.cfg.vocab_size)
    self._graphdef = nnx.graphdef(model)
    # Rows of a decode step's matmuls: every slot verifies K drafts + 1 token.
    self._matmul_rows = config.num_slots * (config.num_draft_tokens + 1)
    self._params = transformer.inference_weights(model, self._matmul_rows)
    self._pool = PagePool(config.num_pages, config.page_size)
    self._memory: dict[tuple[int, ...], collections.deque] = {}
    # Response lengths of the latest finished requests: the scheduler's length model.
    self._length_history: collections.deque[int] = collections.deque(maxlen=LENGTH_HISTORY)
    self._draft_frac: float | None = None  # `_draft_time_fraction`, measured once
    leaf = jax.tree.leaves(self._params)[0]
    mesh = (leaf.sharding.mesh if isinstance(leaf.sharding, NamedSharding)
            else sharding.make_mesh((1, 1, 1)))
    state_sharding = self._state_shardings(mesh)
    self._state = jax.device_put(self._init_state(), state_sharding)
    self._key = jax.random.key(config.seed)
    # Fixed output shardings: the state round-trips through both functions unchanged,
    # so neither recompiles after the first call.
    self._state_sharding = state_sharding
    forward = transformer.inference_compiler_options()
    self._prefill_fn = jax.jit(self._prefill_insert, donate_argnums=2,
                               out_shardings=state_sharding, compiler_options=forward)
    self._recompute_fn = jax.jit(self._recompute_insert, donate_argnums=2,
                                 out_shardings=state_sharding, compiler_options=forward)
    self._take_out_fn = jax.jit(self._take_out, donate_argnums=0)
    self._put_back_fn = jax.jit(self._put_back, donate_argnums=0,
                                out_shardings=state_sharding)
    self._move_fn = jax.jit(self._move_rows, donate_argnums=0, out_shardings=state_sharding)
    # n-gram drafts read sibling slots: every call runs all S slots.
    self._narrow_slots = proposer is None or not proposer.reads_other_slots
    state_and_replicated = (state_sharding, NamedSharding(mesh, P()))
    self._decode_fn = jax.jit(self._decode, donate_argnums=2,
                              static_argnames=("slots", "pages"),
                              out_shardings=state_and_replicated, compiler_options=forward)
    # `_draft_time_fraction`: each phase alone, the state donated as in the device loop.
    self._draft_only = jax.jit(self._draft_alone, donate_argnums=2, static_argnames="pages",
                               out_shardings=state_and_replicated, compiler_options=forward)
    self._verify_only = jax.jit(self._verify_alone, donate_argnums=1, static_argnames="pages",
                                out_shardings=state_and_replicated, compiler_options=forward)
    self.stats = collections.Counter()

  @property
  def history_len(self) -> int:  # Lh: room for the last round's K + 1 writes
    return self.config.max_seq_len + self.config.num_draft_tokens + 1

  # ------------------------------------------------------------------ device side

  def _init_state(self) -> SlotState:
    c, S, N, K = self.config, self.config.num_slots, self.config.max_new_tokens, \
        self.config.num_draft_tokens
    ints = lambda *shape: jnp.zeros(shape or (S,), jnp.int32)  # distinct buffers (donated)
    return SlotState(
        cache=PagedKVCache.init(self.model_config, S, c.num_pages, c.page_size,
                                c.max_pages_per_slot),
        proposer=None if self.proposer is None else self.proposer.init_state(c),
        active=jnp.zeros((S,), bool), length=ints(), last=ints(), rid=ints(),
        group=jnp.full((S,), -1, jnp.int32), num_gen=ints(), max_new=ints(), finish=ints(),
        capacity=ints(),
        history=ints(S, self.history_len), reference=jnp.full((S, c.reference_len), -1, jnp.int32),
        out_tok=ints(S, N), out_lp=jnp.zeros((S, N), jnp.float32),
        out_policy_lp=jnp.zeros((S, N), jnp.float32), counters=ints(3),
        accepted_at=ints(K))

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

  def _write_tokens(self, params, proposer_params, state: SlotState, tokens, lens, pages):
    """Writes ``tokens[n, T]`` (left-padded, real lengths ``lens[n]``) into ``pages[n, M]``
    of the policy's and the proposer's caches. Returns ``(logits of the last token
    [n, 1, V], cache, proposer state)``; rows with ``lens = 0`` write nothing."""
    n, T = tokens.shape
    positions = lens[:, None] - T + jnp.arange(T)[None, :]  # pads < 0
    out = transformer.apply(self._graphdef, params, tokens, positions,
                            cache=state.cache.replace(page_table=pages),
                            logits_at=jnp.full((n, 1), T - 1))
    proposer_state = state.proposer
    if self.proposer is not None:
      proposer_state = self.proposer.prefill(proposer_params, proposer_state, tokens,
                                             positions, pages)
    return out.logits, out.cache.replace(page_table=state.cache.page_table), proposer_state

  def _prefill_insert(self, params, proposer_params, state: SlotState, key, slots, tokens,
                      lens, pages, rids, groups, refs, max_new):
    """Prefills ``tokens[n, T]`` into ``slots[n]``, samples each first token.

    Padding entries carry ``slots = S`` (dropped) and ``lens = 0`` (nothing written).
    """
    logits, cache, proposer_state = self._write_tokens(params, proposer_params, state,
                                                       tokens, lens, pages)
    n, T = tokens.shape
    first = verify(round_keys(key, rids, lens), jnp.zeros((n, 0), jnp.int32), None,
                   logits, self.config.sampling)
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
        finish=put(state.finish, finish), history=put(state.history, hist),
        reference=put(state.reference, refs),
        out_tok=state.out_tok.at[slots, 0].set(tok, mode="drop"),
        out_lp=state.out_lp.at[slots, 0].set(first.logprobs[:, 0], mode="drop"),
        out_policy_lp=state.out_policy_lp.at[slots, 0].set(first.policy_logprobs[:, 0],
                                                            mode="drop"))

  def _take_out(self, state: SlotState, slot, ids):
    """Preemption: ``(state with the slot idle, slot row, contents of pages ids [n])``."""
    row = {f: getattr(state, f)[slot] for f in ROW_FIELDS}
    pools = gather_pages((state.cache.layers, state.proposer), ids)
    return state.replace(active=state.active.at[slot].set(False)), row, pools

  def _move_rows(self, state: SlotState, src, dst) -> SlotState:
    """Moves the rows of slots ``src[n]`` to free slots ``dst[n]`` (pads: ``dst = S``,
    dropped); the vacated slots become idle and groupless (no n-gram sibling)."""
    rows = {f: getattr(state, f)[src] for f in ROW_FIELDS}
    state = state.replace(active=state.active.at[src].set(False, mode="drop"),
                          group=state.group.at[src].set(-1, mode="drop"))
    return state.replace(**{f: getattr(state, f).at[dst].set(rows[f], mode="drop")
                            for f in ROW_FIELDS})

  def _set_row(self, state: SlotState, slot, row) -> SlotState:
    return state.replace(**{f: getattr(state, f).at[slot].set(row[f]) for f in ROW_FIELDS})

  def _put_back(self, state: SlotState, slot, ids, row, pools) -> SlotState:
    """Restores an offloaded sequence: its pages into ``ids`` (pads dropped), its row."""
    layers, proposer = scatter_pages((state.cache.layers, state.proposer), ids, pools)
    return self._set_row(state.replace(cache=state.cache.replace(layers=layers),
                                       proposer=proposer), slot, row)

  def _recompute_insert(self, params, proposer_params, state: SlotState, slot, tokens, lens,
                        pages, row) -> SlotState:
    """Restores a dropped sequence: re-prefills its ``lens`` tokens, then its row."""
    _, cache, proposer_state = self._write_tokens(params, proposer_params, state, tokens,
                                                  lens, pages)
    return self._set_row(state.replace(cache=cache, proposer=proposer_state), slot, row)

  def _draft_phase(self, params, proposer_params, st: SlotState, key):
    """Proposes ``K`` drafts per slot: ``(drafts [S, K], logprobs [S, K, V] | None, state)``."""
    S, K = st.active.shape[0], self.config.num_draft_tokens
    if not K:
      return jnp.zeros((S, 0), jnp.int32), None, st.proposer
    ctx = DraftContext(last=st.last, length=st.length, active=st.active, rid=st.rid,
                       group=st.group, history=st.history, reference=st.reference,
                       page_table=st.cache.page_table, key=key, target_params=params,
                       cache=st.cache)
    return self.proposer.propose(proposer_params, st.proposer, ctx, K, self.config.sampling)

  def _verify_phase(self, params, st: SlotState, drafts):
    """One target forward over ``[last, drafts]`` (K+1 positions per active slot)."""
    K = drafts.shape[1]
    positions = jnp.where(st.active[:, None], st.length[:, None] + jnp.arange(K + 1)[None, :], -1)
    return transformer.apply(self._graphdef, params,
                             jnp.concatenate([st.last[:, None], drafts], 1), positions,
                             cache=st.cache)

  @staticmethod
  def _narrow(state: SlotState, slots: int, pages: int) -> SlotState:
    """The first ``slots`` rows of ``state`` and their first ``pages`` page-table columns."""
    return state.replace(
        **{f: getattr(state, f)[:slots] for f in SLOT_FIELDS},
        cache=state.cache.replace(page_table=state.cache.page_table[:slots, :pages]))

  @staticmethod
  def _widen(full: SlotState, state: SlotState) -> SlotState:
    """``state``, narrowed from ``full`` by `_narrow`, with ``full``'s shapes again."""
    slots = state.active.shape[0]
    return state.replace(
        **{f: getattr(full, f).at[:slots].set(getattr(state, f)) for f in SLOT_FIELDS},
        cache=state.cache.replace(page_table=full.cache.page_table))

  def _draft_alone(self, params, proposer_params, st: SlotState, key, *, pages: int):
    narrow = self._narrow(st, self.config.num_slots, pages)
    drafts, _, proposer_state = self._draft_phase(params, proposer_params, narrow, key)
    return st.replace(proposer=proposer_state), drafts

  def _verify_alone(self, params, st: SlotState, drafts, *, pages: int):
    narrow = self._narrow(st, self.config.num_slots, pages)
    out = self._verify_phase(params, narrow, drafts)
    return self._widen(st, narrow.replace(cache=out.cache)), out.logits

  def _round(self, params, proposer_params, st: SlotState, key) -> tuple[SlotState, jax.Array]:
    """One round: propose K, verify K+1, emit 1..K+1 tokens per active slot."""
    S, N = st.out_tok.shape
    K = self.config.num_draft_tokens
    act = st.active
    drafts, draft_lp, proposer_state = self._draft_phase(params, proposer_params, st, key)
    out = self._verify_phase(params, st, drafts)
    v = verify(round_keys(key, st.rid, st.length + 1), drafts, draft_lp, out.logits,
               self.config.sampling)

    # Truncate at the first EOS and at the request's cap.
    i = jnp.arange(K + 1)[None, :]
    eos = jnp.asarray(self.config.eos_ids, jnp.int32)
    is_eos = jnp.isin(v.tokens, eos) & (i < v.num_emitted[:, None])
    first_eos = jnp.where(jnp.any(is_eos, 1), jnp.argmax(is_eos, 1) + 1, K + 1)
    n = jnp.minimum(jnp.minimum(v.num_emitted, first_eos), st.max_new - st.num_gen)
    n = jnp.where(act, n, 0)  # [S] tokens emitted this round
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
    st = st.replace(
        cache=out.cache, proposer=proposer_state, active=act & (finish == RUNNING),
        length=st.length + n, last=jnp.where(act, last, st.last), num_gen=num_gen,
        finish=finish,
        history=st.history.at[rows, hpos].set(v.tokens, mode="drop"),
        out_tok=st.out_tok.at[rows, col].set(v.tokens, mode="drop"),
        out_lp=st.out_lp.at[rows, col].set(v.logprobs, mode="drop"),
        out_policy_lp=st.out_policy_lp.at[rows, col].set(v.policy_logprobs, mode="drop"),
        counters=st.counters + jnp.stack([act.sum(), K * act.sum(), accepted.sum()]),
        accepted_at=st.accepted_at + accepted.sum(0))
    return st, jnp.any(act & ~st.active)

  def _decode(self, params, proposer_params, state: SlotState, key, stop_on_finish,
              max_rounds, *, slots: int, pages: int):
    """Runs up to ``max_rounds`` rounds; returns ``(state, rounds run)``.

    The rounds see the first ``slots`` (``S_c``) slots and their first ``pages``
    (``M_c``) page-table columns only: attention then reads ``S_c * M_c`` pages per
    layer instead of ``S * M``. The host passes ``S_c`` above every running slot and
    ``M_c >= capacity / Ps`` of every slot, and the loop stops before a slot outgrows
    its capacity, so every row and position a call touches lies inside.
    """
    full, state = state, self._narrow(state, slots, pages)
    room = self.config.num_draft_tokens + 1  # KV positions one round writes

    def cond(carry):
      rounds, st, finished = carry
      needs_pages = jnp.any(st.active & (st.length + room > st.capacity))
      return ((rounds < max_rounds) & jnp.any(st.active) & ~(stop_on_finish & finished)
              & ~needs_pages)

    def body(carry):
      rounds, st, finished = carry
      st, newly = self._round(params, proposer_params, st, key)
      return rounds + 1, st, finished | newly

    rounds, state, _ = jax.lax.while_loop(cond, body, (jnp.int32(0), state, jnp.bool_(False)))
    return self._widen(full, state), rounds

  # ------------------------------------------------------------------ host side

  def update_params(self, model: Decoder) -> None:
    """Uses ``model``'s weights for the next rollouts (same config required)."""
    if model.cfg != self.model_config:
      raise ValueError("update_params needs a model with the engine's ModelConfig")
    self._params = transformer.inference_weights(model, self._matmul_rows)

  def memory_state(self) -> dict:
    """The per-prompt rollout memory (n-gram references) as JSON-able lists, newest
    first, for checkpoints: ``{"prompts": [...], "rollouts": [[seq, ...], ...]}``."""
    prompts = list(self._memory)
    return {"prompts": [list(p) for p in prompts],
            "rollouts": [[list(s) for s in self._memory[p]] for p in prompts]}

  def load_memory_state(self, memory: dict) -> None:
    """Restores what `memory_state` returned (replaces the current memory)."""
    self._memory = {tuple(p): collections.deque((list(s) for s in seqs), maxlen=4)
                    for p, seqs in zip(memory["prompts"], memory["rollouts"])}

  def _bucket_len(self, n: int) -> int:
    b = self.config.min_prefill_len
    while b < n:
      b *= 2
    return min(b, self.config.max_seq_len)

  def _bucket_batch(self, n: int) -> int:
    return min(_pow2(n), self.config.num_slots)

  def _max_new(self, r: Request) -> int:
    return self.config.max_new_tokens if r.max_new_tokens is None else r.max_new_tokens

  def _pages_needed(self, r: Request) -> int:
    # K slack: the last round may write K + 1 positions past the response's end.
    return self._pool.pages_for(len(r.prompt) + self._max_new(r) + self.config.num_draft_tokens)

  def _validate(self, requests: Sequence[Request]) -> None:
    c = self.config
    ids = [r.request_id for r in requests]
    if len(set(ids)) != len(ids):
      raise ValueError("request_id values must be unique within a generate call")
    for r in requests:
      max_new = self._max_new(r)
      if not r.prompt:
        raise ValueError(f"request {r.request_id}: empty prompt")
      if not 1 <= max_new <= c.max_new_tokens:
        raise ValueError(f"request {r.request_id}: max_new_tokens={max_new} outside"
                         f" [1, {c.max_new_tokens}] (EngineConfig.max_new_tokens)")
      total = len(r.prompt) + max_new + c.num_draft_tokens
      if total > c.max_seq_len:
        raise ValueError(f"request {r.request_id}: prompt ({len(r.prompt)} tokens) +"
                         f" max_new_tokens ({max_new}) + draft slack ({c.num_draft_tokens})"
                         f" = {total} exceeds max_seq_len {c.max_seq_len}")
      need = self._pages_needed(r)
      if need > c.num_pages:
        raise ValueError(f"request {r.request_id} needs {need} KV pages but the budget is"
                         f" {c.num_pages} pages (EngineConfig.num_pages): it can never fit")
      if max(r.prompt) >= self.model_config.vocab_size or min(r.prompt) < 0:
        raise ValueError(f"request {r.request_id}: token id outside [0,"
                         f" {self.model_config.vocab_size})")

  def generate(self, requests: Sequence[Request]) -> RolloutResult:
    """Completes every request (continuous batching under the KV page budget, with
    preemption: rollout/scheduler.py); responses in request order."""
    self._validate(requests)
    t0 = time.perf_counter()
    c, K = self.config, self.config.num_draft_tokens
    before = self._device_counters()
    stats0 = collections.Counter(self.stats)
    # Sibling matching (ngram) must not see slots left over from an earlier call.
    group = self._state.group
    self._state = self._state.replace(group=jax.device_put(np.full(group.shape, -1, np.int32),
                                                           group.sharding))
    sched = Scheduler(c.scheduler, self._pool, c.num_slots, K + 1, requests,
                      lambda r: len(r.prompt) + self._max_new(r) + K, self._length_history)
    done: dict[int, Response] = {}
    trace = []  # per device call: (rounds, busy slot fraction)
    rounds_at = collections.Counter()  # decode rounds per M_c

    while sched.busy():
      for seq, mode in sched.plan_preemptions():
        self._preempt(sched, seq, mode)
      sched.grow()
      while (seq := sched.restore_next()) is not None:
        self._restore(seq)
      admitted = []
      while (seq := sched.admit_next()) is not None:
        admitted.append(seq)
      if admitted:
        self._state = self._prefill(admitted)
      self._compact(sched)
      self._push_page_tables(sched)
      slot_rounds0 = int(self._state.counters[0])
      slots, pages = self._call_shape(sched)
      t_call = time.perf_counter()  # the device is idle: counters[0] was just read
      self._state, rounds = self._decode_fn(
          self._params, self._proposer_params(), self._state, self._key,
          jnp.bool_(bool(sched.queue or sched.preempted)), jnp.int32(c.round_budget),
          slots=slots, pages=pages)
      rounds = int(rounds)
      self.stats["decode_s"] += time.perf_counter() - t_call
      rounds_at[pages] += rounds
      self.stats["device_calls"] += 1
      self.stats["rounds"] += rounds
      if rounds:
        busy = (int(self._state.counters[0]) - slot_rounds0) / (rounds * c.num_slots)
        trace.append((rounds, busy))
      length, finish = jax.device_get((self._state.length, self._state.finish))
      finished = []
      for slot, seq in sched.running.items():
        seq.length = int(length[slot])
        if finish[slot] != RUNNING:
          finished.append(slot)
      if finished:
        self._collect([sched.finish(slot) for slot in finished], finished, done)
    self.stats.update(sched.stats)
    self._length_history.extend(sched.finished_lengths)
    responses = [done[r.request_id] for r in requests]
    metrics = self._metrics(before, stats0, responses, time.perf_counter() - t0)
    metrics["utilization_trace"] = trace
    if K:
      if self._draft_frac is None:  # 4 extra forwards: once per engine, not per call
        self._draft_frac = self._draft_time_fraction(
            max(rounds_at, key=rounds_at.get, default=c.max_pages_per_slot))
      metrics["draft_time_frac"] = self._draft_frac
    return RolloutResult(responses, metrics)

  def _push_page_tables(self, sched: Scheduler) -> None:
    """The running sequences' page ids and capacities, host -> device."""
    c = self.config
    table = np.zeros((c.num_slots, c.max_pages_per_slot), np.int32)
    capacity = np.zeros((c.num_slots,), np.int32)
    for slot, seq in sched.running.items():
      table[slot, :len(seq.pages)] = seq.pages
      capacity[slot] = len(seq.pages) * c.page_size
    sh = self._state_sharding
    self._state = self._state.replace(
        cache=self._state.cache.replace(page_table=jax.device_put(table, sh.cache.page_table)),
        capacity=jax.device_put(capacity, sh.capacity))

  def _compact(self, sched: Scheduler) -> None:
    """Moves running rows into the lowest free slots when that shrinks the next call's
    ``S_c`` (not for proposers that read other slots)."""
    if not self._narrow_slots or not sched.running:
      return
    if self._slot_bucket(len(sched.running)) >= self._slot_bucket(max(sched.running) + 1):
      return
    moves = sched.compact()
    S = self.config.num_slots
    src, dst = np.full((2, min(_pow2(len(moves)), S)), S, np.int32)
    src[:len(moves)], dst[:len(moves)] = zip(*moves)
    self._state = self._move_fn(self._state, jnp.asarray(src), jnp.asarray(dst))

  def _slot_bucket(self, n: int) -> int:
    """The fewest slots ``S / 4^j >= n``: few compiled variants (each (S_c, M_c) pair
    compiles once; with powers of two, long-recipe SD steps kept compiling new pairs
    mid-run), still a quarter of the rows or less for a batch's tail."""
    S = self.config.num_slots
    while S % 4 == 0 and S // 4 >= n:
      S //= 4
    return S

  def _call_shape(self, sched: Scheduler) -> tuple[int, int]:
    """``(S_c, M_c)`` of the next decode call: the slots up to the highest running one
    in `_slot_bucket`'s steps (all ``S`` for proposers that read other slots), and the
    most pages a running slot holds rounded up to a power of two, capped at ``M``.

    Long-response recipe (`configs/counting_long.yaml`, M = 163, 16 slots, lengths
    450-2,500): slots hold 18 pages at admission and grow 16 at a time, so calls read
    32, 64, 128 or 163 columns instead of 163 every round; as responses finish, the
    rest run in 4 or 1 slots."""
    c = self.config
    slots = c.num_slots
    if self._narrow_slots:
      slots = self._slot_bucket(max(sched.running, default=0) + 1)
    held = max((len(seq.pages) for seq in sched.running.values()), default=1)
    return slots, min(_pow2(held), c.max_pages_per_slot)

  def _page_ids(self, pages: list[int]) -> np.ndarray:
    """``pages`` padded with the out-of-range id ``P`` to a power of two (few compiles)."""
    n = min(_pow2(len(pages)), self.config.max_pages_per_slot)
    ids = np.full((n,), self.config.num_pages, np.int32)
    ids[:len(pages)] = pages
    return ids

  def _preempt(self, sched: Scheduler, seq: SeqState, mode: str) -> None:
    """Takes ``seq`` off its slot: its row (and, to offload, the pages its KV fills) to
    host memory."""
    written = sched.filled_pages(seq) if mode == "offload" else []
    self._state, row, pools = self._take_out_fn(self._state, jnp.int32(seq.slot),
                                                jnp.asarray(self._page_ids(written)))
    saved = {"row": jax.device_get(row)}
    if mode == "offload":
      saved["pools"] = jax.device_get(pools)
      saved["num_pages"] = len(written)
      self.stats["offload_bytes"] += len(written) * self._page_bytes()
    sched.preempt(seq, mode, saved)

  def _restore(self, seq: SeqState) -> None:
    """Puts preempted ``seq`` back on its (new) slot with its (new) pages."""
    row = seq.saved["row"]
    if seq.mode == "offload":
      n = seq.saved["num_pages"]
      ids = self._page_ids(seq.pages[:n])
      self._state = self._put_back_fn(self._state, jnp.int32(seq.slot), jnp.asarray(ids),
                                      row, seq.saved["pools"])
      self.stats["restore_bytes"] += n * self._page_bytes()
    else:
      length = seq.length
      T = self._bucket_len(length)
      tokens = np.zeros((1, T), np.int32)
      tokens[0, T - length:] = row["history"][:length]
      pages = np.zeros((1, self.config.max_pages_per_slot), np.int32)
      pages[0, :len(seq.pages)] = seq.pages
      self._state = self._recompute_fn(
          self._params, self._proposer_params(), self._state, jnp.int32(seq.slot),
          jnp.asarray(tokens), jnp.asarray([length], jnp.int32), jnp.asarray(pages), row)
      self.stats["recompute_tokens"] += length
    seq.saved, seq.mode = None, ""

  def _page_bytes(self) -> int:
    return page_bytes((self._state.cache.layers, self._state.proposer))

  def _draft_time_fraction(self, pages: int, reps: int = 5) -> float:
    """Share of a round spent drafting: propose calls and verify forwards alternated
    ``reps`` times after one compiling call each, medians compared (one timing of each
    swung between 0.04 and 0.49 on a shared CPU). The shapes set the cost, so
    `generate` measures it after an engine's first rollout only, at the ``M_c``
    (``pages``) most of that rollout's rounds read.

    The engine state is threaded through both calls and donated, as in the device loop,
    so neither timing includes a copy of the KV pools (with 67 MB of pools a verify
    that copied them took 34 ms, in place 9.5 ms). After a rollout every slot is
    inactive, so the calls write nothing to the caches."""
    t_draft, t_verify = [], []
    for _ in range(reps + 1):  # call 0 compiles; dropped below
      t = time.perf_counter()
      self._state, drafts = jax.block_until_ready(
          self._draft_only(self._params, self._proposer_params(), self._state, self._key,
                           pages=pages))
      t_draft.append(time.perf_counter() - t)
      t = time.perf_counter()
      self._state, _ = jax.block_until_ready(self._verify_only(self._params, self._state,
                                                               drafts, pages=pages))
      t_verify.append(time.perf_counter() - t)
    d, v = float(np.median(t_draft[1:])), float(np.median(t_verify[1:]))
    return d / (d + v)

  def _proposer_params(self):
    return None if self.proposer is None else self.proposer.params(self.config.num_slots)

  def _device_counters(self) -> np.ndarray:
    return np.concatenate([np.asarray(self._state.counters), np.asarray(self._state.accepted_at)])

  def _metrics(self, before, stats0, responses, wall) -> dict:
    delta = self._device_counters() - before
    slot_rounds, drafted, accepted = (int(x) for x in delta[:3])
    K = self.config.num_draft_tokens
    stats = dict.fromkeys(SCHEDULER_STATS, 0)
    stats.update({k: v - stats0.get(k, 0) for k, v in self.stats.items()})
    rounds = stats.get("rounds", 0)
    emitted = sum(len(r.tokens) for r in responses)
    return {
        **stats, "slot_rounds": slot_rounds, "drafted_tokens": drafted,
        "accepted_tokens": accepted, "emitted_tokens": emitted, "wall_s": wall,
        "tokens_per_s": emitted / wall if wall > 0 else 0.0,
        "acceptance_length": 1.0 + accepted / slot_rounds if slot_rounds and K else 1.0,
        "acceptance_at": (delta[3:] / slot_rounds).tolist() if slot_rounds and K else [],
        "slot_utilization": slot_rounds / (rounds * self.config.num_slots) if rounds else 0.0,
    }

  def _reference_row(self, r: Request) -> np.ndarray:
    """Earlier rollouts of ``r``'s prompt (newest first), ``-1`` separated and padded."""
    R = self.config.reference_len
    row = np.full((R,), -1, np.int32)
    pos = 0
    for seq in self._memory.get(tuple(r.prompt), ()):
      take = min(len(seq), R - pos)
      row[pos:pos + take] = seq[:take]
      pos += take + 1
      if pos >= R:
        break
    return row

  def _prefill(self, admitted: list[SeqState]) -> SlotState:
    c, S = self.config, self.config.num_slots
    n = self._bucket_batch(len(admitted))
    T = self._bucket_len(max(len(q.request.prompt) for q in admitted))
    slots = np.full((n,), S, np.int32)
    tokens = np.zeros((n, T), np.int32)
    lens, rids = np.zeros((n,), np.int32), np.zeros((n,), np.int32)
    max_new = np.ones((n,), np.int32)
    groups = np.full((n,), -1, np.int32)
    pages = np.zeros((n, c.max_pages_per_slot), np.int32)
    refs = np.full((n, c.reference_len), -1, np.int32)
    for i, seq in enumerate(admitted):
      r = seq.request
      slots[i], lens[i], rids[i], groups[i] = seq.slot, len(r.prompt), r.request_id, r.group_id
      max_new[i] = self._max_new(r)
      tokens[i, T - len(r.prompt):] = r.prompt
      pages[i, :len(seq.pages)] = seq.pages
      if c.reference_len:
        refs[i] = self._reference_row(r)
    self.stats["prefills"] += 1
    return self._prefill_fn(self._params, self._proposer_params(), self._state, self._key,
                            *map(jnp.asarray, (slots, tokens, lens, pages, rids, groups, refs,
                                               max_new)))

  def _collect(self, seqs: list[SeqState], slots: list[int], done) -> None:
    st = self._state
    num_gen, finish = np.asarray(st.num_gen), np.asarray(st.finish)
    toks, lps, plps = jax.device_get((st.out_tok, st.out_lp, st.out_policy_lp))
    for seq, s in zip(seqs, slots):
      r = seq.request
      n = int(num_gen[s])
      done[r.request_id] = Response(
          request_id=r.request_id, prompt=list(r.prompt), tokens=toks[s, :n].tolist(),
          logprobs=lps[s, :n].copy(), policy_logprobs=plps[s, :n].copy(),
          finish_reason=FINISH_REASONS[int(finish[s])])
      if self.config.reference_len:
        mem = self._memory.setdefault(tuple(r.prompt), collections.deque(maxlen=4))
        mem.appendleft(list(r.prompt) + done[r.request_id].tokens)

  # ------------------------------------------------------------------ text API

  def generate_text(self, prompts: Sequence[str], max_new_tokens: int | None = None,
                    first_request_id: int = 0) -> list[tuple[str, Response]]:
    """Encodes ``prompts`` with the engine's tokenizer, generates, decodes."""
    if self.tokenizer is None:
      raise ValueError("generate_text needs an engine built with a tokenizer")
    reqs = [Request(self.tokenizer.encode(p), first_request_id + i, max_new_tokens)
            for i, p in enumerate(prompts)]
    return [(self.tokenizer.decode(r.tokens), r) for r in self.generate(reqs).responses]
