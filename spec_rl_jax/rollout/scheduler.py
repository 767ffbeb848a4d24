"""The KV-aware scheduler: who runs, who grows, who is preempted and how (host side).

Sequences hold KV pages on demand: a prompt's pages plus ``grow_tokens`` of room at
admission, another ``grow_tokens`` whenever the device loop stops because a slot has
no room for its next round (``length + K + 1 > capacity``). When the pool cannot cover
the growth every running sequence needs *now*, a policy that reclaims first takes back
the room other sequences hold beyond their next round (pages nothing was written to:
no bytes move); if that is not enough, victims are preempted:

  * ``offload``: the pages their KV fills (every page pool in the engine state, bit
    for bit; room beyond ``length`` holds nothing a later round reads) and their slot
    row go to host memory; restore copies them into fresh pages;
  * ``recompute``: only the slot row is kept; restore re-prefills the ``length``
    tokens of the sequence into fresh pages.

Preempted sequences come back (FIFO) ahead of new requests; whether a new request may
start while they wait is the policy's (``can_fill``). Sampling is
keyed by (request id, position), so a preempted sequence continues exactly as if it
had never stopped.

Policies (registry, one signature — `Policy`):

  ``kv_aware``  reclaims unused room before it preempts; admission control: admit
                when the pool covers every sequence up to its cap (no preemption
                can follow); otherwise only while the *expected peak* of the pages
                held (`Scheduler.expected_peak`: every running sequence and the
                newcomer grow, and finish with the probabilities of the response
                lengths finished so far, in this call and the engine's earlier
                ones) plus ``watermark`` of the pool fits; before any response
                length is known (the engine's first call, until one finishes):
                while the pages plus the watermark fit;
                victims are the sequences that are cheapest to bring back (fewest
                pages; those up to ``recompute_max_tokens`` are recomputed, not
                offloaded); a preempted sequence comes back under the same rule as
                admission, so it is not preempted again at once (hysteresis); while
                preempted sequences wait for that, new requests still start when
                their pages plus the watermark fit (*fill*): they keep the slots busy
                and, holding the fewest pages, are the first victims if room runs
                short again.
  ``naive``     admit whenever the prompt's pages fit, preempt the newest sequence by
                offloading, restore as soon as its pages fit; nothing new starts while
                a preempted sequence waits.

Glossary: a *chunk* is ``grow_tokens`` of KV; *must-grow* slots cannot run one more
round without a page; ``P`` pages in the pool, ``Ps`` page size.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from spec_rl_jax.rollout.paged_cache import PagePool


LENGTH_HISTORY = 1024  # latest finished response lengths the length model uses

# Counters every rollout reports (RolloutResult.metrics), zero when nothing happened.
SCHEDULER_STATS = ("admission_waits", "reclaimed_pages", "preemptions", "offloads",
                   "recomputes", "restores", "offload_bytes", "restore_bytes",
                   "recompute_tokens", "slot_moves")


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
  """How the engine shares its KV page budget (see the module docstring)."""

  policy: str = "kv_aware"  # kv_aware | naive (registered in `POLICIES`)
  grow_tokens: int = 256  # KV room added per growth (a chunk)
  # kv_aware: fraction of the pool kept free for hysteresis: more moves fewer bytes at
  # some throughput (`bench.schedule_replay` compares values; docs/benchmarks.md)
  watermark: float = 0.02
  # kv_aware: victims up to this length are recomputed instead of offloaded: a
  # recompute moves no bytes but re-prefills the sequence, which costs a few decode
  # rounds for a few hundred tokens (`bench.schedule_replay` charges it and sweeps this
  # value; docs/benchmarks.md)
  recompute_max_tokens: int = 512

  def __post_init__(self):
    if self.grow_tokens <= 0:
      raise ValueError(f"grow_tokens must be positive, got {self.grow_tokens}")
    if not 0 <= self.watermark < 1:
      raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
    if self.recompute_max_tokens < 0:
      raise ValueError("recompute_max_tokens must be >= 0")


@dataclasses.dataclass
class SeqState:
  """A request the engine has started: running in ``slot`` or preempted."""

  request: Any  # rollout.types.Request
  max_tokens: int  # prompt + max_new + K: the most KV it can ever need
  tick: int  # admission order (newest = largest)
  pages: list[int] = dataclasses.field(default_factory=list)
  slot: int = -1  # -1 while preempted
  length: int = 0  # tokens in its KV cache (host mirror, refreshed after each call)
  mode: str = ""  # while preempted: "offload" | "recompute"
  saved: Any = None  # while preempted: slot row (+ page contents when offloaded)


@dataclasses.dataclass(frozen=True)
class Policy:
  """A scheduling policy: three decisions, each a pure function of host bookkeeping.

  ``can_admit(scheduler, seq, pages)``: may new ``seq`` start now with ``pages``?
  ``can_restore(scheduler, seq, pages)``: may preempted ``seq`` come back with ``pages``?
  ``can_fill(scheduler, seq, pages)``: may new ``seq`` start while preempted sequences
  wait (the head of their queue could not come back)?
  ``victims(scheduler, running, short)``: ``[(seq, mode)]`` freeing ``>= short`` pages.
  ``reclaim``: take back unused room (`Scheduler.reclaim`) before preempting anyone.
  """

  can_admit: Callable[["Scheduler", SeqState, int], bool]
  can_restore: Callable[["Scheduler", SeqState, int], bool]
  can_fill: Callable[["Scheduler", SeqState, int], bool]
  victims: Callable[["Scheduler", list[SeqState], int], list[tuple[SeqState, str]]]
  reclaim: bool


def _take_until(order: list[SeqState], short: int, mode: Callable[[SeqState], str]):
  out, freed = [], 0
  for seq in order:
    if freed >= short:
      break
    out.append((seq, mode(seq)))
    freed += len(seq.pages)
  return out


def _kv_aware_admit(s: "Scheduler", seq: SeqState, pages: int) -> bool:
  # Safe: the pool covers every sequence up to its cap, so no preemption can follow.
  worst = sum(s.pages_for(q.max_tokens) - len(q.pages) for q in s.running.values())
  if s.pool.num_free >= worst + s.pages_for(seq.max_tokens):
    return True
  if not s.num_known_lengths():
    # Nothing to model lengths on yet (no response has finished, in this call or an
    # earlier one): counting every sequence to its cap would run a handful of slots
    # until the first finishes, so admit while the pages fit, keeping the watermark.
    return s.pool.num_free >= pages + s.watermark_pages
  # Otherwise: the expected peak of the pages held by the running sequences and the
  # newcomer as they grow and finish, plus the watermark.
  return s.expected_peak(seq, pages) + s.watermark_pages <= s.pool.num_pages


def _kv_aware_fill(s: "Scheduler", seq: SeqState, pages: int) -> bool:
  # Preempted sequences wait for the admission rule; a newcomer keeps a slot busy
  # meanwhile (more throughput than leaving the slot empty, for a few more bytes moved
  # when it is preempted in turn).
  return s.pool.num_free >= pages + s.watermark_pages


def _kv_aware_victims(s: "Scheduler", running: list[SeqState], short: int):
  # Cheapest to bring back first: fewest pages; among equals the newest.
  order = sorted(running, key=lambda q: (len(q.pages), -q.tick))
  limit = s.config.recompute_max_tokens
  return _take_until(order, short, lambda q: "recompute" if q.length <= limit else "offload")


POLICIES: dict[str, Policy] = {
    "kv_aware": Policy(
        can_admit=_kv_aware_admit, can_restore=_kv_aware_admit, can_fill=_kv_aware_fill,
        victims=_kv_aware_victims, reclaim=True),
    "naive": Policy(
        can_admit=lambda s, seq, pages: s.pool.num_free >= pages,
        can_restore=lambda s, q, pages: s.pool.num_free >= pages,
        can_fill=lambda s, seq, pages: False,
        victims=lambda s, running, short: _take_until(
            sorted(running, key=lambda q: -q.tick), short, lambda q: "offload"),
        reclaim=False),
}


class Scheduler:
  """Host bookkeeping of a rollout engine: the request queue (``submit``), running and
  preempted sequences, free slots and the page pool. The engine executes the decisions
  on the device (preempt, grow, restore, admit, in that order) and reports lengths and
  finished slots back. ``finished_lengths`` keeps the latest `LENGTH_HISTORY` response
  lengths (seeded with ``length_history``): the length model of `expected_peak`."""

  def __init__(self, config: SchedulerConfig, pool: PagePool, num_slots: int,
               round_tokens: int, requests: Sequence[Any], max_tokens: Callable[[Any], int],
               length_history: Sequence[int] = ()):
    if config.policy not in POLICIES:
      raise ValueError(f"unknown scheduler policy {config.policy!r}; registered:"
                       f" {sorted(POLICIES)}")
    self.config, self.pool, self.policy = config, pool, POLICIES[config.policy]
    self.round_tokens = round_tokens  # K_max + 1: the most KV one round writes
    self.queue: collections.deque[Any] = collections.deque(requests)
    self.preempted: collections.deque[SeqState] = collections.deque()
    self.running: dict[int, SeqState] = {}
    self.free_slots = list(range(num_slots))
    self._max_tokens = max_tokens
    self._ticks = itertools.count()
    self.watermark_pages = int(config.watermark * pool.num_pages)
    self.stats = collections.Counter()
    self.finished_lengths: collections.deque[int] = collections.deque(length_history,
                                                                      maxlen=LENGTH_HISTORY)
    self._sorted_lengths: np.ndarray | None = None  # finished_lengths sorted (`expected_peak`)

  def submit(self, requests) -> None:
    self.queue.extend(requests)

  def busy(self) -> bool:
    return bool(self.queue or self.preempted or self.running)

  def num_known_lengths(self) -> int:
    """Response lengths `expected_peak` models on."""
    return len(self.finished_lengths)

  def pages_for(self, tokens: int) -> int:
    return self.pool.pages_for(tokens)

  def filled_pages(self, seq: SeqState) -> list[int]:
    """The pages ``seq``'s KV fills: what an offload copies (the room after them holds
    nothing a later round reads before writing it)."""
    return seq.pages[:self.pages_for(seq.length)]

  def pages_with_room(self, seq: SeqState, tokens: int) -> int:
    """Pages for ``seq``'s KV plus room for ``tokens`` more (at most its cap)."""
    return self.pages_for(min(seq.length + tokens, seq.max_tokens))

  def next_chunk(self, seq: SeqState) -> int:
    """Pages ``seq`` would take at its next growth."""
    return max(0, self.pages_with_room(seq, self.config.grow_tokens) - len(seq.pages))

  def expected_peak(self, seq: SeqState, pages: int) -> float:
    """Expected peak of the pages held by the running sequences and ``seq`` (holding
    ``pages``) from now on, over response lengths drawn from those finished so far.

    A sequence with ``d`` response tokens is still running ``t`` tokens later with
    probability ``P(len > d + t | len > d)`` (the empirical survival of the finished
    lengths; a sequence longer than all of them, or any before one has finished,
    counts as running to its cap) and then holds ``pages_for(length + t + K + 1)``.
    The expectation sums these over the sequences at each ``t`` (a grid of pages).
    """
    seqs = [*self.running.values(), seq]
    held = np.array([len(q.pages) for q in seqs[:-1]] + [pages])  # [n]
    length = np.array([q.length for q in seqs])
    cap = np.array([q.max_tokens for q in seqs])
    done = length - np.array([len(q.request.prompt) for q in seqs])
    Ps = self.pool.page_size
    t = np.arange(0, int((cap - length).max()) + Ps, Ps)[:, None]  # [T, 1]
    if self._sorted_lengths is None:  # sorted once per finish, not per admission check
      self._sorted_lengths = np.sort(np.asarray(self.finished_lengths, np.int64))
    lens = self._sorted_lengths
    above = lambda x: len(lens) - np.searchsorted(lens, x, side="right")  # #{len > x}
    alive_now = above(done)  # [n]
    survive = np.where(alive_now > 0, above(done + t) / np.maximum(alive_now, 1), 1.0)
    survive = np.where(length + t < cap, survive, 0.0)  # [T, n]
    size = -(-np.minimum(length + t + self.round_tokens, cap) // Ps)  # pages_for
    return float((survive * np.maximum(held, size)).sum(1).max())

  def _spare(self, seq: SeqState) -> int:
    """Pages ``seq`` holds beyond its next round (its KV and the round's writes);
    negative: it must grow first."""
    return len(seq.pages) - self.pages_with_room(seq, self.round_tokens)

  def _must_grow(self, seq: SeqState) -> int:
    """Pages ``seq`` needs before it can run one more round."""
    return max(0, -self._spare(seq))

  def finish(self, slot: int) -> SeqState:
    seq = self.running.pop(slot)
    self.finished_lengths.append(seq.length - len(seq.request.prompt) + 1)
    self._sorted_lengths = None
    self.pool.release(seq.pages)
    seq.pages = []
    self.free_slots.append(slot)
    return seq

  def plan_preemptions(self) -> list[tuple[SeqState, str]]:
    """Victims to preempt so every running sequence can run its next round."""
    short = sum(self._must_grow(q) for q in self.running.values()) - self.pool.num_free
    if short > 0 and self.policy.reclaim:
      short -= self.reclaim(short)
    if short <= 0:
      return []
    victims = self.policy.victims(self, list(self.running.values()), short)
    if sum(len(q.pages) + self._must_grow(q) for q, _ in victims) < short:
      raise AssertionError("preemption cannot free enough pages")  # validated budgets
    return victims

  def reclaim(self, short: int) -> int:
    """Releases up to ``short`` pages of room held beyond the next round (the tail of
    a sequence's page list: nothing written there), most spare room first; returns
    how many. The engine pushes the shrunk page tables before the next device call."""
    freed = 0
    for seq in sorted(self.running.values(), key=self._spare, reverse=True):
      n = min(self._spare(seq), short - freed)
      if n <= 0:
        break
      self.pool.release(seq.pages[-n:])
      del seq.pages[-n:]
      freed += n
    self.stats["reclaimed_pages"] += freed
    return freed

  def preempt(self, seq: SeqState, mode: str, saved: Any) -> None:
    del self.running[seq.slot]
    self.free_slots.append(seq.slot)
    self.pool.release(seq.pages)
    self.stats["preemptions"] += 1
    self.stats[mode + "s"] += 1
    seq.pages, seq.slot, seq.mode, seq.saved = [], -1, mode, saved
    self.preempted.append(seq)

  def grow(self) -> None:
    """Gives every running sequence the pages its next round needs (preemption made
    room), then tops up the sequences with less than half a chunk of room, emptiest
    first, while pages last."""
    for seq in self.running.values():
      if must := self._must_grow(seq):
        seq.pages += self.pool.allocate(must)
    room = lambda q: len(q.pages) * self.pool.page_size - q.length
    for seq in sorted(self.running.values(), key=room):
      if 2 * room(seq) >= self.config.grow_tokens:
        break
      if n := min(self.next_chunk(seq), self.pool.num_free):
        seq.pages += self.pool.allocate(n)

  def restore_next(self) -> SeqState | None:
    """The next preempted sequence, if the policy lets it back now (slot + pages set)."""
    if not self.preempted or not self.free_slots:
      return None
    seq = self.preempted[0]
    pages = self.pages_with_room(seq, self.config.grow_tokens)
    if not (self.policy.can_restore(self, seq, pages) or not self.running):
      return None
    self.preempted.popleft()
    self._place(seq, pages)
    self.stats["restores"] += 1
    return seq

  def admit_next(self) -> SeqState | None:
    """The next queued request, if it may start now (FIFO; call after `restore_next`:
    preempted sequences come back first, and while they wait ``can_fill`` decides)."""
    if not self.queue or not self.free_slots:
      return None
    req = self.queue[0]
    seq = SeqState(request=req, max_tokens=self._max_tokens(req), tick=next(self._ticks),
                   length=len(req.prompt))
    pages = self.pages_with_room(seq, self.config.grow_tokens)
    if self.preempted:
      ok = self.policy.can_fill(self, seq, pages)
    else:
      ok = self.policy.can_admit(self, seq, pages) or not self.running
    if not ok:
      self.stats["admission_waits"] += 1
      return None
    self.queue.popleft()
    self._place(seq, pages)
    return seq

  def compact(self) -> list[tuple[int, int]]:
    """Moves running sequences from the highest slots into the lowest free ones until
    they hold slots ``0..n-1``; returns the ``(from, to)`` slot moves for the engine to
    copy (pages stay with their sequence)."""
    moves = []
    while self.running and self.free_slots and min(self.free_slots) < max(self.running):
      src, dst = max(self.running), min(self.free_slots)
      seq = self.running.pop(src)
      seq.slot = dst
      self.running[dst] = seq
      self.free_slots.remove(dst)
      self.free_slots.append(src)
      moves.append((src, dst))
    self.stats["slot_moves"] += len(moves)
    return moves

  def _place(self, seq: SeqState, pages: int) -> None:
    seq.slot = min(self.free_slots)  # the lowest: busy slots stay a prefix
    self.free_slots.remove(seq.slot)
    seq.pages = self.pool.allocate(pages)
    self.running[seq.slot] = seq
