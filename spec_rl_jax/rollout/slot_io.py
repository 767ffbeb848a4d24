"""Host-side inputs of the engine's device programs, built from the scheduler's sequences.

`SlotIO` turns scheduling decisions (rollout/scheduler.py) into calls of the device
programs (rollout/device.py) and threads the `SlotState` in and out explicitly:

  ``prefill``       admitted requests → a bucketed ``(n, T)`` prompt batch and their
                    proposer rows (`Proposer.request_rows`);
  ``resync``        sequences whose proposer state missed positions → ``resync``;
  ``page_tables``   the running sequences' page ids and KV capacities → device;
  ``call_shape`` / ``compact`` / ``shrink_at``   the next decode call's ``(S_c, M_c)``
                    bucket, row moves that shrink ``S_c``, and the active count at which
                    a call stops because a smaller ``S_c`` would do;
  ``preempt`` / ``restore``      a sequence's row (and, to offload, its pages) to host
                    memory and back, or re-prefilled from its history.

Shape legend: ``S`` slots, ``n`` prefill batch bucket, ``T`` prefill length bucket,
``M`` max pages per slot.
"""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np

from spec_rl_jax.rollout import buckets
from spec_rl_jax.rollout.device import DevicePrograms, SlotState
from spec_rl_jax.rollout.scheduler import Scheduler, SeqState
from spec_rl_jax.rollout.types import EngineConfig, Request
from spec_rl_jax.spec.proposers.base import Proposer


class SlotIO:
  """Builds each device program's inputs; ``stats`` counts prefills, resyncs and the
  bytes and tokens preemption moves."""

  def __init__(self, programs: DevicePrograms, config: EngineConfig,
               proposer: Proposer | None, scheduler: Scheduler, stats: collections.Counter):
    self.programs, self.config, self.proposer = programs, config, proposer
    self.scheduler, self.stats = scheduler, stats

  def request_sampling(self, r: Request):
    return self.config.sampling if r.sampling is None else r.sampling

  def max_new(self, r: Request) -> int:
    return self.config.max_new_tokens if r.max_new_tokens is None else r.max_new_tokens

  # ---------------------------------------------------------------- admission

  def prefill(self, state: SlotState, weights, draft_weights, key,
              admitted: list[SeqState]) -> SlotState:
    """Prefills the admitted sequences' prompts into their slots."""
    c, S = self.config, self.config.num_slots
    n = buckets.prefill_batch(S, len(admitted))
    T = buckets.prefill_len(c.min_prefill_len, c.max_seq_len,
                            max(len(q.request.prompt) for q in admitted))
    slots = np.full((n,), S, np.int32)
    tokens = np.zeros((n, T), np.int32)
    lens, rids = np.zeros((n,), np.int32), np.zeros((n,), np.int32)
    max_new = np.ones((n,), np.int32)
    groups = np.full((n,), -1, np.int32)
    temperature = np.zeros((n,), np.float32)
    pages = np.zeros((n, c.max_pages_per_slot), np.int32)
    for i, seq in enumerate(admitted):
      r = seq.request
      slots[i], lens[i], rids[i], groups[i] = seq.slot, len(r.prompt), r.request_id, r.group_id
      max_new[i] = self.max_new(r)
      temperature[i] = self.request_sampling(r).temperature
      tokens[i, T - len(r.prompt):] = r.prompt
      pages[i, :len(seq.pages)] = seq.pages
    rows = self._proposer_rows(state, [q.request for q in admitted], n)
    self.stats["prefills"] += 1
    return self.programs.prefill(
        weights, draft_weights, state, key,
        *map(jnp.asarray, (slots, tokens, lens, pages, rids, groups)), rows,
        *map(jnp.asarray, (max_new, temperature)))

  def _proposer_rows(self, state: SlotState, requests: list[Request], n: int):
    """The proposer's rows for ``requests``, stacked and padded to ``n`` (rows a proposer
    does not give start as zeros)."""
    rows = state.proposer.rows
    if not jax.tree.leaves(rows):
      return rows
    per = [self.proposer.request_rows(r) for r in requests]

    def stack(name, like):
      out = np.zeros((n, *like.shape[1:]), like.dtype)
      for i, p in enumerate(per):
        if name in p:
          out[i] = p[name]
      return jnp.asarray(out)

    return {name: stack(name, like) for name, like in rows.items()}

  def resync(self, state: SlotState, weights, draft_weights, stale: list[SeqState]
             ) -> SlotState:
    """Re-prefills the proposer state of ``stale`` running sequences from their
    histories."""
    c = self.config
    n = buckets.prefill_batch(c.num_slots, len(stale))
    slots = np.full((n,), c.num_slots, np.int32)
    slots[:len(stale)] = [q.slot for q in stale]
    T = buckets.prefill_len(c.min_prefill_len, c.max_seq_len, max(q.length for q in stale))
    self.stats["resyncs"] += len(stale)
    return self.programs.resync(weights, draft_weights, state, jnp.asarray(slots), T=T)

  # ---------------------------------------------------------------- the call's shape

  def page_tables(self, state: SlotState) -> SlotState:
    """The running sequences' page ids and capacities, host -> device."""
    c = self.config
    table = np.zeros((c.num_slots, c.max_pages_per_slot), np.int32)
    capacity = np.zeros((c.num_slots,), np.int32)
    for slot, seq in self.scheduler.running.items():
      table[slot, :len(seq.pages)] = seq.pages
      capacity[slot] = len(seq.pages) * c.page_size
    sh = self.programs.state_sharding
    return state.replace(
        cache=state.cache.replace(page_table=jax.device_put(table, sh.cache.page_table)),
        capacity=jax.device_put(capacity, sh.capacity))

  def narrow_slots(self) -> bool:
    """Whether a call may run only the busy leading slots (not when drafts read other
    slots' rows: finished siblings would vanish)."""
    return self.proposer is None or not self.proposer.reads_other_slots

  def compact(self, state: SlotState) -> SlotState:
    """Moves running rows into the lowest free slots when that shrinks the next call's
    ``S_c``."""
    running, S = self.scheduler.running, self.config.num_slots
    if not self.narrow_slots() or not running:
      return state
    if buckets.slot_bucket(S, len(running)) >= buckets.slot_bucket(S, max(running) + 1):
      return state
    moves = self.scheduler.compact()
    src, dst = np.full((2, min(buckets.pow2(len(moves)), S)), S, np.int32)
    src[:len(moves)], dst[:len(moves)] = zip(*moves)
    return self.programs.move_rows(state, jnp.asarray(src), jnp.asarray(dst))

  def call_shape(self) -> tuple[int, int, int]:
    """``(S_c, M_c, S_c at k = 0)`` of the next decode call: the slots up to the highest
    running one (all ``S`` for speculative calls of proposers that read other slots) and
    the most pages a running slot holds, bucketed (rollout/buckets.py)."""
    c, running = self.config, self.scheduler.running
    ar_slots = buckets.slot_bucket(c.num_slots, max(running, default=0) + 1)
    held = max((len(seq.pages) for seq in running.values()), default=1)
    return (ar_slots if self.narrow_slots() else c.num_slots,
            buckets.page_bucket(c.max_pages_per_slot, held), ar_slots)

  def shrink_at(self, slots: int) -> int:
    """Active slots at or below which a call at ``S_c = slots`` should stop: compaction
    then moves the rest into the next smaller slot bucket (0: there is none, or no
    compaction, for proposers that read other slots)."""
    smaller = slots // 4
    if not self.narrow_slots() or slots % 4 or len(self.scheduler.running) <= smaller:
      return 0
    return smaller

  # ---------------------------------------------------------------- preemption

  def _page_ids(self, pages: list[int]) -> jax.Array:
    return jnp.asarray(buckets.page_ids(pages, self.config.num_pages,
                                        self.config.max_pages_per_slot))

  def preempt(self, state: SlotState, seq: SeqState, mode: str, page_bytes: int
              ) -> SlotState:
    """Takes ``seq`` off its slot: its row (and, to offload, the pages its KV fills) to
    host memory, handed to the scheduler."""
    written = self.scheduler.filled_pages(seq) if mode == "offload" else []
    state, row, pools = self.programs.take_out(state, jnp.int32(seq.slot),
                                               self._page_ids(written))
    saved = {"row": jax.device_get(row)}
    if mode == "offload":
      saved["pools"] = jax.device_get(pools)
      saved["num_pages"] = len(written)
      self.stats["offload_bytes"] += len(written) * page_bytes
    self.scheduler.preempt(seq, mode, saved)
    return state

  def restore(self, state: SlotState, weights, draft_weights, seq: SeqState, page_bytes: int
              ) -> SlotState:
    """Puts preempted ``seq`` back on its (new) slot with its (new) pages."""
    row = seq.saved["row"]
    if seq.mode == "offload":
      n = seq.saved["num_pages"]
      state = self.programs.put_back(state, jnp.int32(seq.slot), self._page_ids(seq.pages[:n]),
                                     row, seq.saved["pools"])
      self.stats["restore_bytes"] += n * page_bytes
    else:
      c, length = self.config, seq.length
      T = buckets.prefill_len(c.min_prefill_len, c.max_seq_len, length)
      tokens = np.zeros((1, T), np.int32)
      tokens[0, T - length:] = row["history"][:length]
      pages = np.zeros((1, c.max_pages_per_slot), np.int32)
      pages[0, :len(seq.pages)] = seq.pages
      state = self.programs.recompute(
          weights, draft_weights, state, jnp.int32(seq.slot), jnp.asarray(tokens),
          jnp.asarray([length], jnp.int32), jnp.asarray(pages), row)
      self.stats["recompute_tokens"] += length
    seq.saved, seq.mode = None, ""
    return state
