"""The rollout engine's host side: admission, scheduling, collection, and the serving API.

Incremental API (JetStream's prefill / insert / generate shape):

  ``submit(requests)``   validates and queues requests (nothing runs yet);
  ``step()``             one scheduling pass and one device call of decode rounds:
                         preempt / grow / restore / admit (prefill + insert) / compact,
                         then up to ``round_budget`` rounds; returns each request's new
                         tokens (`TokenDelta`);
  ``drain()``            steps until idle; returns the finished `Response`s;
  ``generate(requests)`` submit + drain, responses in request order plus metrics;
  ``stream_text(prompt)`` yields the text of one request as it is produced.

``set_weights(policy, drafter=None, version=...)`` installs new weights between steps
(copies: a learner may donate its buffers afterwards); every token's weights version is
recorded in ``Response.policy_versions``.

Before each device call the `SpecController` chooses the draft length ``k``
(``0..max_draft_tokens``); the device programs (rollout/device.py) are compiled per
``(k, S_c, M_c)`` (rollout/buckets.py); their inputs are built from the scheduler's
sequences by rollout/slot_io.py. Proposers that keep a KV cache are re-prefilled from
the sequences' histories before drafting again after calls with ``k = 0``.

Each request samples at its own temperature (``Request.sampling``; top-k and top-p are
the engine's). Sampling randomness is keyed by ``(seed, request_id, position)``, so a
response does not depend on the slot, the batch or the weights' layout it ran with
(callers give fresh request ids, or a new seed, when they want fresh samples); sampled
speculative responses also depend on the drafts (the same distribution, other draws).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from spec_rl_jax import sharding
from spec_rl_jax.models import layout as layouts
from spec_rl_jax.models.tokenizer import Tokenizer, check_vocab
from spec_rl_jax.models.transformer import Decoder
from spec_rl_jax.rollout.device import RUNNING, DevicePrograms, SlotState
from spec_rl_jax.rollout.paged_cache import PagePool, page_bytes
from spec_rl_jax.rollout.slot_io import SlotIO
from spec_rl_jax.rollout.scheduler import SCHEDULER_STATS, Scheduler
from spec_rl_jax.rollout.types import (FINISH_REASONS, EngineConfig, Request, Response,
                                       RolloutResult, TokenDelta)
from spec_rl_jax.spec.controller import CallShape, CallStats, FixedK, SpecController
from spec_rl_jax.spec.proposers.base import Proposer


def _run_clock(seconds: float) -> float:
  """Process 0's measurement of a call in a multi-process run: every process's
  controller then sees the same history and chooses the same draft lengths, so all
  launch the same programs (their collectives pair up by order)."""
  if jax.process_count() == 1:
    return seconds
  return float(multihost_utils.broadcast_one_to_all(np.float32(seconds)))


class RolloutEngine:
  """Continuous-batching (speculative) generation over a paged KV cache.

  ``proposer`` drafts up to ``config.max_draft_tokens`` tokens per round; ``controller``
  picks the draft length of each device call (default: always the maximum);
  ``layout`` is the backend's inference weight layout (default: `layout.for_backend`);
  ``mesh``: the devices the engine runs on (default: the policy's mesh, or one device),
  where it keeps its KV pools and its copies of the policy's and the drafter's weights,
  from wherever those are given (e.g. a learner on other devices).
  """

  def __init__(self, model: Decoder, config: EngineConfig, tokenizer: Tokenizer | None = None,
               proposer: Proposer | None = None, controller: SpecController | None = None,
               layout: layouts.StackedLayout | None = None,
               mesh: jax.sharding.Mesh | None = None):
    K = config.max_draft_tokens
    if (K > 0) != (proposer is not None):
      raise ValueError("max_draft_tokens > 0 needs a proposer, and a proposer needs"
                       f" max_draft_tokens > 0 (got K_max={K})")
    if proposer is not None:
      self._check_proposer(proposer, model, K)
    if tokenizer is not None:
      check_vocab(tokenizer, model.cfg.vocab_size)
    self.controller = controller if controller is not None else FixedK(K)
    if self.controller.max_draft_tokens != K:
      raise ValueError(f"controller max_draft_tokens {self.controller.max_draft_tokens} !="
                       f" engine max_draft_tokens {K}")
    self.config, self.model_config = config, model.cfg
    self.tokenizer, self.proposer = tokenizer, proposer
    self.layout = layouts.for_backend() if layout is None else layout
    if mesh is None:
      mesh = sharding.mesh_of(nnx.state(model)) or sharding.make_mesh((1, 1, 1))
    self.mesh = mesh
    self.version = 0
    self._draft_weights = None
    self._install(model, proposer.model() if proposer is not None else None)
    self.programs = DevicePrograms(nnx.graphdef(model), model.cfg, config, proposer,
                                   self.mesh, self.layout.compiler_options)
    self._state = self.programs.initial_state()
    self._key = jax.random.key(config.seed)
    self._pool = PagePool(config.num_pages, config.page_size)
    self._sched = Scheduler(config.scheduler, self._pool, config.num_slots, K + 1, (),
                            lambda r: len(r.prompt) + self._io.max_new(r) + K)
    self._stale: set[int] = set()  # request ids whose proposer state missed positions
    self._num_gen: dict[int, int] = {}  # request id -> tokens generated (host mirror)
    self._versions: dict[int, list[tuple[int, int]]] = {}  # rid -> [(from token, version)]
    self._finished: dict[int, Response] = {}
    self.decode_shapes: set[tuple[int, int, int]] = set()  # (k, S_c, M_c) compiled
    self.stats = collections.Counter()
    self._io = SlotIO(self.programs, config, proposer, self._sched, self.stats)
    self.rounds_at_k = collections.Counter()
    self._trace: list[tuple[int, float]] = []  # per device call: (rounds, busy fraction)

  # ------------------------------------------------------------------ weights

  def _check_proposer(self, proposer: Proposer, model: Decoder, K: int) -> None:
    if proposer.draft_limit is not None and K > proposer.draft_limit:
      raise ValueError(f"the {proposer.name} proposer drafts at most {proposer.draft_limit}"
                       f" tokens per round; max_draft_tokens is {K}")
    L = model.cfg.num_layers
    bad = [i for i in proposer.hidden_layers if not 0 <= i < L]
    if bad:
      raise ValueError(f"{proposer.name} asks for hidden layers {bad}; the policy has"
                       f" layers 0..{L - 1}")
    if proposer.vocab_size is not None and proposer.vocab_size != model.cfg.vocab_size:
      raise ValueError(f"proposer vocab_size {proposer.vocab_size} != policy vocab_size"
                       f" {model.cfg.vocab_size}")

  def _install(self, policy: Decoder, drafter: Decoder | None) -> None:
    """Lays out (copies) ``policy``'s weights, and ``drafter``'s when given."""
    rows = self.config.num_slots * (self.config.max_draft_tokens + 1)
    self._weights = self.layout.weights(policy, rows, self.mesh)
    if drafter is not None:
      self._draft_weights = self.layout.weights(drafter, self.config.num_slots, self.mesh)

  def set_weights(self, policy: Decoder, drafter: Decoder | None = None,
                  version: int | None = None) -> int:
    """Uses ``policy`` (and, when given, the proposer's new ``drafter``; else the
    drafter's weights stay) for every round from the next `step` on; the engine keeps
    copies, never aliases, so the caller may donate its buffers afterwards. ``version``
    (default: the current one + 1) is recorded for the tokens generated with these
    weights. Returns it."""
    if policy.cfg != self.model_config:
      raise ValueError("set_weights needs a policy with the engine's ModelConfig")
    if drafter is not None:
      if self.proposer is None:
        raise ValueError("set_weights got a drafter but the engine has no proposer")
      self.proposer.set_model(drafter)
    self._install(policy, drafter)
    self.version = self.version + 1 if version is None else int(version)
    for seq in (*self._sched.running.values(), *self._sched.preempted):
      rid = seq.request.request_id
      self._versions[rid].append((self._num_gen[rid], self.version))
    return self.version

  @property
  def state(self) -> SlotState:
    """The device state (donated by the next call: read it, do not keep it)."""
    return self._state

  @property
  def free_pages(self) -> int:
    return self._pool.num_free

  def page_bytes(self) -> int:
    """Bytes one KV page occupies across the policy's and the proposer's pools."""
    return page_bytes((self._state.cache.layers, self._state.proposer.pools))

  # ------------------------------------------------------------------ requests

  def _validate(self, requests: Sequence[Request]) -> None:
    c, K = self.config, self.config.max_draft_tokens
    ids = [r.request_id for r in requests]
    if len(set(ids)) != len(ids):
      raise ValueError("request_id values must be unique within a generate call")
    busy = set(self._num_gen) & set(ids)
    if busy:
      raise ValueError(f"request ids {sorted(busy)[:5]} are still in flight")
    for r in requests:
      max_new = self._io.max_new(r)
      if not r.prompt:
        raise ValueError(f"request {r.request_id}: empty prompt")
      if not 1 <= max_new <= c.max_new_tokens:
        raise ValueError(f"request {r.request_id}: max_new_tokens={max_new} outside"
                         f" [1, {c.max_new_tokens}] (EngineConfig.max_new_tokens)")
      total = len(r.prompt) + max_new + K
      if total > c.max_seq_len:
        raise ValueError(f"request {r.request_id}: prompt ({len(r.prompt)} tokens) +"
                         f" max_new_tokens ({max_new}) + draft slack ({K})"
                         f" = {total} exceeds max_seq_len {c.max_seq_len}")
      need = self._pool.pages_for(total)
      if need > c.num_pages:
        raise ValueError(f"request {r.request_id} needs {need} KV pages but the budget is"
                         f" {c.num_pages} pages (EngineConfig.num_pages): it can never fit")
      sp = r.sampling
      if sp is not None and not sp.greedy and (sp.top_k, sp.top_p) != (c.sampling.top_k,
                                                                       c.sampling.top_p):
        raise ValueError(f"request {r.request_id}: top_k={sp.top_k}, top_p={sp.top_p} differ"
                         f" from the engine's (top_k={c.sampling.top_k},"
                         f" top_p={c.sampling.top_p}); only the temperature may vary per"
                         " request")
      if max(r.prompt) >= self.model_config.vocab_size or min(r.prompt) < 0:
        raise ValueError(f"request {r.request_id}: token id outside [0,"
                         f" {self.model_config.vocab_size})")

  def max_new_tokens_for(self, prompt_len: int) -> int:
    """The most new tokens a request with a ``prompt_len``-token prompt may ask for (0:
    the prompt does not fit)."""
    c, K = self.config, self.config.max_draft_tokens
    room = min(c.max_seq_len, c.num_pages * c.page_size) - prompt_len - K
    return max(0, min(c.max_new_tokens, room))

  def submit(self, requests: Sequence[Request]) -> None:
    """Queues ``requests`` (validated first: nothing is queued if one is bad)."""
    self._validate(requests)
    for r in requests:
      self._num_gen[r.request_id] = 0
      self._versions[r.request_id] = [(0, self.version)]
    self._sched.submit(requests)

  def busy(self) -> bool:
    return self._sched.busy()

  # ------------------------------------------------------------------ the loop

  def step(self) -> list[TokenDelta]:
    """One scheduling pass and one device call; the tokens each request produced."""
    sched, c = self._sched, self.config
    if not sched.busy():
      return []
    io, w, dw = self._io, self._weights, self._draft_weights
    for seq, mode in sched.plan_preemptions():
      self._state = io.preempt(self._state, seq, mode, self.page_bytes())
    sched.grow()
    while (seq := sched.restore_next()) is not None:
      if seq.mode == "recompute":  # re-prefilled with the policy and the proposer
        self._stale.discard(seq.request.request_id)
      self._state = io.restore(self._state, w, dw, seq, self.page_bytes())
    admitted = []
    while (seq := sched.admit_next()) is not None:
      admitted.append(seq)
    if admitted:
      self._state = io.prefill(self._state, w, dw, self._key, admitted)
    self._state = io.page_tables(io.compact(self._state))
    shape = CallShape(len(sched.running), *io.call_shape())
    k = self.controller.choose(shape)
    slots, pages = shape.slots_at(k), shape.pages
    if not 0 <= k <= c.max_draft_tokens:
      raise ValueError(f"controller chose k={k} outside [0, {c.max_draft_tokens}]"
                       " (max_draft_tokens)")
    stale = [q for q in sched.running.values() if q.request.request_id in self._stale]
    if k and stale:
      self._state = io.resync(self._state, w, dw, stale)
      self._stale -= {q.request.request_id for q in stale}
    before = self._device_counters()
    t_call = time.perf_counter()  # the device is idle: the counters were just read
    self._state, rounds = self.programs.decode(
        w, dw, self._state, self._key,
        jnp.bool_(bool(sched.queue or sched.preempted)), jnp.int32(c.round_budget),
        jnp.int32(io.shrink_at(slots)), k=k, slots=slots, pages=pages)
    rounds = int(rounds)
    seconds = _run_clock(time.perf_counter() - t_call)
    first_call = (k, slots, pages) not in self.decode_shapes
    self.decode_shapes.add((k, slots, pages))
    self.stats["decode_s"] += seconds
    self.stats["device_calls"] += 1
    self.stats["rounds"] += rounds
    self.rounds_at_k[k] += rounds
    delta = self._device_counters() - before
    K = max(c.max_draft_tokens, 1)
    self.controller.observe(CallStats(k, slots, pages, rounds, int(delta[0]),
                                      delta[4:4 + K][:k], seconds, first_call))
    if rounds:
      self._trace.append((rounds, int(delta[0]) / (rounds * c.num_slots)))
    if k == 0 and self.proposer is not None and self.proposer.catches_up:
      self._stale.update(q.request.request_id for q in sched.running.values())
    return self._collect_step()

  def _collect_step(self) -> list[TokenDelta]:
    st, sched = self._state, self._sched
    length, finish, num_gen, toks, lps = jax.device_get(
        (st.length, st.finish, st.num_gen, st.out_tok, st.out_lp))
    deltas, finished = [], []
    for slot, seq in sched.running.items():
      rid = seq.request.request_id
      seq.length = int(length[slot])
      n0, n = self._num_gen[rid], int(num_gen[slot])
      self._num_gen[rid] = n
      done = finish[slot] != RUNNING
      deltas.append(TokenDelta(rid, toks[slot, n0:n].tolist(), lps[slot, n0:n].copy(),
                               FINISH_REASONS[int(finish[slot])]))
      if done:
        finished.append(slot)
    if finished:
      plps = jax.device_get(st.out_policy_lp)
      for slot in finished:
        seq = sched.finish(slot)
        r = seq.request
        n = int(num_gen[slot])
        tokens = toks[slot, :n].tolist()
        self._finished[r.request_id] = Response(
            request_id=r.request_id, prompt=list(r.prompt), tokens=tokens,
            logprobs=lps[slot, :n].copy(), policy_logprobs=plps[slot, :n].copy(),
            finish_reason=FINISH_REASONS[int(finish[slot])],
            policy_versions=self._token_versions(r.request_id, n))
        del self._num_gen[r.request_id]
        self._stale.discard(r.request_id)
        if self.proposer is not None:
          self.proposer.on_finished(r, tokens)
    return deltas

  def _token_versions(self, rid: int, n: int) -> np.ndarray:
    out = np.zeros((n,), np.int32)
    for start, version in self._versions.pop(rid):
      out[start:] = version
    return out

  def drain(self) -> list[Response]:
    """Steps until every submitted request finished; the responses finished since the
    last `drain` (in finishing order)."""
    while self._sched.busy():
      self.step()
    done, self._finished = list(self._finished.values()), {}
    return done

  def generate(self, requests: Sequence[Request]) -> RolloutResult:
    """Completes every request (continuous batching under the KV page budget, with
    preemption: rollout/scheduler.py); responses in request order, plus metrics."""
    t0 = time.perf_counter()
    was_idle = not self._sched.busy()
    self.submit(requests)
    if was_idle:  # n-gram siblings must not match an earlier call's slots
      self._state = self._state.replace(group=jax.device_put(
          np.full(self._state.group.shape, -1, np.int32), self._state.group.sharding))
    before = self._device_counters()
    stats0, k0 = collections.Counter(self.stats), collections.Counter(self.rounds_at_k)
    control0 = collections.Counter(self.controller.stats)
    sched0 = collections.Counter(self._sched.stats)
    self._trace = []
    done = {r.request_id: r for r in self.drain()}
    responses = [done[r.request_id] for r in requests]
    wall = time.perf_counter() - t0
    metrics = self._metrics(before, stats0, sched0, responses, wall)
    metrics["rounds_at_k"] = {k: v - k0.get(k, 0) for k, v in self.rounds_at_k.items()
                              if v - k0.get(k, 0)}
    metrics["utilization_trace"] = self._trace
    metrics["controller"] = {k: v - control0.get(k, 0)
                             for k, v in self.controller.stats.items()}
    return RolloutResult(responses, metrics)

  def stream_text(self, prompt: str, max_new_tokens: int | None = None,
                  request_id: int | None = None) -> Iterator[str]:
    """Yields the response to ``prompt`` as text, piece by piece, while it is generated
    (other submitted requests progress alongside)."""
    if self.tokenizer is None:
      raise ValueError("stream_text needs an engine built with a tokenizer")
    rid = request_id if request_id is not None else (
        max([*self._num_gen, *self._finished, -1]) + 1 + (1 << 30))
    self.submit([Request(self.tokenizer.encode(prompt), rid, max_new_tokens)])
    tokens, text = [], ""
    while True:
      for d in self.step():
        if d.request_id != rid:
          continue
        tokens += d.tokens
        new = self.tokenizer.decode(tokens)
        if new != text and not new.endswith("\ufffd"):  # wait for a whole character
          yield new[len(text):]
          text = new
      if rid in self._finished:
        self._finished.pop(rid)
        new = self.tokenizer.decode(tokens)
        if new != text:
          yield new[len(text):]
        return

  def generate_text(self, prompts: Sequence[str], max_new_tokens: int | None = None,
                    first_request_id: int = 0) -> list[tuple[str, Response]]:
    """Encodes ``prompts`` with the engine's tokenizer, generates, decodes."""
    if self.tokenizer is None:
      raise ValueError("generate_text needs an engine built with a tokenizer")
    reqs = [Request(self.tokenizer.encode(p), first_request_id + i, max_new_tokens)
            for i, p in enumerate(prompts)]
    return [(self.tokenizer.decode(r.tokens), r) for r in self.generate(reqs).responses]

  # ------------------------------------------------------------------ metrics

  def _device_counters(self) -> np.ndarray:
    return np.concatenate([np.asarray(self._state.counters),
                           np.asarray(self._state.accepted_at)])

  def _metrics(self, before, stats0, sched0, responses, wall) -> dict:
    delta = self._device_counters() - before
    slot_rounds, drafted, accepted, spec_rounds = (int(x) for x in delta[:4])
    stats = dict.fromkeys(SCHEDULER_STATS, 0)
    stats.update({k: v - sched0.get(k, 0) for k, v in self._sched.stats.items()})
    stats.update({k: v - stats0.get(k, 0) for k, v in self.stats.items()})
    rounds = stats.get("rounds", 0)
    emitted = sum(len(r.tokens) for r in responses)
    K = self.config.max_draft_tokens
    return {
        **stats, "slot_rounds": slot_rounds, "drafted_tokens": drafted,
        "accepted_tokens": accepted, "emitted_tokens": emitted, "wall_s": wall,
        "tokens_per_s": emitted / wall if wall > 0 else 0.0,
        "acceptance_length": 1.0 + accepted / spec_rounds if spec_rounds else 1.0,
        "acceptance_at": (delta[4:4 + K] / spec_rounds).tolist() if spec_rounds else [],
        "slot_utilization": slot_rounds / (rounds * self.config.num_slots) if rounds else 0.0,
    }
