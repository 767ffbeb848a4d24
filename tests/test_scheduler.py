"""The KV-aware scheduler: under a page budget too small for every slot, sequences are
preempted (offloaded or recomputed) and restored, and every request still ends with
exactly the output it has under an unlimited budget."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spec_rl_jax.models import eagle3, hf_io, mtp
from spec_rl_jax.rollout.engine import RolloutEngine
from spec_rl_jax.rollout.paged_cache import PagePool
from spec_rl_jax.rollout.scheduler import Scheduler, SchedulerConfig, SeqState
from spec_rl_jax.rollout.types import EngineConfig, Request
from spec_rl_jax.sampling import SamplingParams
from spec_rl_jax.rollout import buckets
from spec_rl_jax.rollout.scheduler import Scheduler as _Scheduler
from spec_rl_jax.spec.proposers.draft_model import DraftModelConfig, DraftModelProposer
from spec_rl_jax.spec.proposers.eagle3 import Eagle3Proposer, Eagle3ProposerConfig
from spec_rl_jax.spec.proposers.mtp import MTPProposer, MTPProposerConfig
from tests import hf_fixtures

V = 96
GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(temperature=1.0, top_k=20)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
  d = str(tmp_path_factory.mktemp("target"))
  hf_fixtures.build("qwen3", d, tie=True, seed=1)
  return hf_io.load_hf_checkpoint(d, load_tokenizer=False)[0]


def _requests(n=10, seed=0):
  """Short responses first, then long ones: the kv_aware policy's estimate of response
  length (the mean of those finished) runs low, so it too admits more than fits later."""
  rng = np.random.default_rng(seed)
  return [Request(rng.integers(1, V, rng.integers(4, 20)).tolist(), i,
                  max_new_tokens=int(rng.integers(4, 9) if i < 4 else rng.integers(30, 41)))
          for i in range(n)]


def _engine(target, num_pages, sampling, K=0, proposer=None, **sched):
  cfg = EngineConfig(num_slots=4, page_size=4, num_pages=num_pages, max_seq_len=96,
                     max_new_tokens=40, round_budget=16, sampling=sampling, eos_ids=(11,),
                     max_draft_tokens=K, seed=3,
                     scheduler=SchedulerConfig(**{"grow_tokens": 8, **sched}))
  return RolloutEngine(target, cfg, proposer=proposer)


def _same(a, b):
  """Same tokens and finish reasons; logprobs within fp32 rounding (a schedule changes
  prefill batch shapes, and a recomputed prefix is summed in another order than
  token-by-token decoding; offloaded KV itself is copied bit for bit, tested below)."""
  assert [r.tokens for r in a.responses] == [r.tokens for r in b.responses]
  for x, y in zip(a.responses, b.responses):
    assert x.finish_reason == y.finish_reason
    np.testing.assert_allclose(x.logprobs, y.logprobs, rtol=0, atol=1e-5)
    np.testing.assert_allclose(x.policy_logprobs, y.policy_logprobs, rtol=0, atol=1e-5)


@pytest.mark.parametrize("policy,sampling", [
    pytest.param("kv_aware", SAMPLED, id="kv_aware-sampled", marks=pytest.mark.slow),
    pytest.param("kv_aware", GREEDY, id="kv_aware-greedy", marks=pytest.mark.slow),
    pytest.param("naive", SAMPLED, id="naive-sampled", marks=pytest.mark.slow),
    pytest.param("naive", GREEDY, id="naive-greedy", marks=pytest.mark.slow)])
def test_tight_budget_same_outputs_as_unlimited(target, sampling, policy):
  reqs = _requests()
  free = _engine(target, 400, sampling).generate(reqs)
  assert free.metrics.get("preemptions", 0) == 0
  # 24 pages of 4 tokens: a long request alone needs up to 15, four slots need ~40.
  engine = _engine(target, 24, sampling, policy=policy, recompute_max_tokens=30)
  tight = engine.generate(reqs)
  m = tight.metrics
  _same(free, tight)
  assert m["preemptions"] > 0 and m["restores"] == m["preemptions"]
  assert m["offloads"] + m["recomputes"] == m["preemptions"]
  assert m["restore_bytes"] == m["offload_bytes"] == (m["offloads"] > 0) * m["offload_bytes"]
  assert engine.free_pages == 24  # nothing leaked
  assert 0 < m["slot_utilization"] <= 1
  assert (m["reclaimed_pages"] > 0) == (policy == "kv_aware")


@pytest.mark.slow
def test_offload_only_and_recompute_only(target):
  """Both preemption modes on their own give the unlimited-budget outputs."""
  reqs = _requests(seed=1)
  free = _engine(target, 400, SAMPLED).generate(reqs)
  for limit, mode in [(0, "offloads"), (10_000, "recomputes")]:
    tight = _engine(target, 24, SAMPLED, recompute_max_tokens=limit).generate(reqs)
    _same(free, tight)
    assert tight.metrics[mode] == tight.metrics["preemptions"] > 0


@pytest.mark.parametrize("policy", [
    "kv_aware", pytest.param("naive", marks=pytest.mark.slow)])
def test_speculative_rounds_under_tight_budget(target, policy, monkeypatch):
  """Draft-model SD: its own KV pools are offloaded with the policy's, and reclaimed
  room is cut behind the rows the last round's rejected drafts wrote. Room a victim
  holds beyond its ``length`` stays behind: an offload copies ``ceil(length / Ps)``
  pages (the draft's pools hold rejected drafts past ``length``)."""
  reqs = _requests(seed=2)
  draft = DraftModelProposer(DraftModelConfig(), target)
  free = _engine(target, 400, SAMPLED, K=3, proposer=draft).generate(reqs)
  engine = _engine(target, 26, SAMPLED, K=3, proposer=draft, recompute_max_tokens=0,
                   policy=policy, grow_tokens=16)
  seen, preempt = [], _Scheduler.preempt

  def spy(sched, seq, mode, saved):  # (pages held, pages the KV fills, pages copied)
    held, filled = len(seq.pages), -(-seq.length // engine.config.page_size)
    seen.append((held, filled, saved.get("num_pages", 0)))
    preempt(sched, seq, mode, saved)

  monkeypatch.setattr(_Scheduler, "preempt", spy)
  tight = engine.generate(reqs)
  _same(free, tight)
  m = tight.metrics
  assert m["offloads"] > 0 if policy == "naive" else m["reclaimed_pages"] > 0
  assert seen and all(copied == filled for _, filled, copied in seen)
  assert m["restore_bytes"] == m["offload_bytes"]
  if policy == "naive":  # room was held and left behind
    assert any(held > filled for held, filled, _ in seen)


@pytest.mark.parametrize("K", [0, pytest.param(3, marks=pytest.mark.slow)])
def test_decode_calls_run_only_the_busy_slots_and_page_columns(target, monkeypatch, K):
  """Each decode call runs ``S_c`` = S / 4^j >= highest running slot + 1 slots (as requests
  finish, running rows move to the lowest free slots) and reads ``M_c`` = pow2(most
  pages a slot holds) page-table columns; the outputs equal those of an engine that
  never moves rows and runs all ``S`` slots and ``M`` columns (sampled, AR and drafts)."""
  reqs = _requests(seed=1)
  proposer = lambda: DraftModelProposer(DraftModelConfig(), target) if K else None
  S, M = 4, 96 // 4
  engine = _engine(target, 400, SAMPLED, K=K, proposer=proposer())
  narrow = engine.generate(reqs)
  ks, slots, pages = zip(*engine.decode_shapes)
  assert set(ks) == {K} and {8, 16} <= set(pages) and max(pages) < M
  assert set(slots) == {1, 4} and narrow.metrics["slot_moves"] > 0
  monkeypatch.setattr(buckets, "slot_bucket", lambda num_slots, n: S)  # no moves either
  monkeypatch.setattr(buckets, "page_bucket", lambda max_pages, held: M)
  wide = _engine(target, 400, SAMPLED, K=K, proposer=proposer())
  out = wide.generate(reqs)
  _same(narrow, out)
  assert wide.decode_shapes == {(K, S, M)} and out.metrics["slot_moves"] == 0


def test_offload_restore_is_bit_identical(target):
  engine = _engine(target, 64, GREEDY, K=2,
                   proposer=DraftModelProposer(DraftModelConfig(), target))
  programs, st = engine.programs, engine.state
  rand = lambda x, i: jax.random.normal(jax.random.key(i), x.shape, x.dtype)
  layers = tuple(rand(x, i) for i, x in enumerate(st.cache.layers))
  prop = st.proposer.replace(pools=tuple(rand(x, 10 + i) for i, x in
                                         enumerate(st.proposer.pools)))
  st = st.replace(cache=st.cache.replace(layers=layers), proposer=prop,
                  length=st.length.at[1].set(17))
  src, dst = [5, 9, 2], [40, 41, 63]
  ids = lambda p: jnp.asarray(buckets.page_ids(p, 64, engine.config.max_pages_per_slot))
  before = jax.device_get((st.cache.layers, st.proposer.pools))
  st, row, pools = programs.take_out(st, jnp.int32(1), ids(src))
  row, pools = jax.device_get((row, pools))
  assert not bool(st.active[1]) and int(row["length"]) == 17
  st = programs.put_back(st, jnp.int32(3), ids(dst), row, pools)
  after = jax.device_get((st.cache.layers, st.proposer.pools))
  for b, a in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
    np.testing.assert_array_equal(b[:, :, src], a[:, :, dst])  # bit-identical copies
    keep = np.setdiff1d(np.arange(b.shape[2]), dst)
    np.testing.assert_array_equal(b[:, :, keep], a[:, :, keep])  # nothing else touched
  assert int(st.length[3]) == 17


def test_budget_errors(target):
  engine = _engine(target, 8, GREEDY)  # 8 pages of 4 = 32 tokens
  with pytest.raises(ValueError, match="can never fit"):
    engine.generate([Request([1] * 10, 0, max_new_tokens=30)])
  with pytest.raises(ValueError, match="unknown scheduler policy"):
    _engine(target, 64, GREEDY, policy="lottery").generate(_requests(1))
  with pytest.raises(ValueError, match="grow_tokens"):
    SchedulerConfig(grow_tokens=0)


@pytest.mark.parametrize("extra_pages", [0, -1])
def test_kv_aware_admits_every_slot_when_the_pool_covers_every_cap(extra_pages):
  """With pages for every slot's worst case the watermark must not hold requests back
  (it did: 32 slots with exactly 32 caps of pages ran 28 and then 4); one page fewer
  and, with no response length known yet, pages plus the watermark must fit."""
  slots, cap = 8, 12  # pages per request: (prompt 64 + 128 new) / page size 16
  reqs = [Request([1] * 64, i, max_new_tokens=128) for i in range(slots)]
  sched = Scheduler(SchedulerConfig(grow_tokens=256), PagePool(slots * cap + extra_pages, 16),
                    num_slots=slots, round_tokens=1, requests=reqs,
                    max_tokens=lambda r: len(r.prompt) + r.max_new_tokens)
  admitted = 0
  while sched.admit_next() is not None:
    admitted += 1
  assert admitted == (slots if extra_pages == 0 else slots - 1)
  assert sched.stats["admission_waits"] == (0 if extra_pages == 0 else 1)


@pytest.mark.parametrize("history", [[], [60] * 10], ids=["cold", "warm"])
def test_kv_aware_admission_before_and_after_lengths_are_known(history):
  """Pool of 100 pages of 4, watermark 2 pages; requests of prompt 4 and cap 64 tokens
  (16 pages) are admitted with 3 pages (prompt + 8 tokens of room). Cold, nothing to
  model lengths on: admit while 3 + 2 pages are free, 32 of them. Warm, every response
  ran to its cap: 6 fit their caps (16 * 6 + 2 <= 100; 7 do not)."""
  reqs = [Request([1] * 4, i, max_new_tokens=60) for i in range(40)]
  s = Scheduler(SchedulerConfig(grow_tokens=8), PagePool(100, 4), num_slots=40,
                round_tokens=1, requests=reqs, max_tokens=lambda r: 64,
                length_history=history)
  admitted = 0
  while s.admit_next() is not None:
    admitted += 1
  assert admitted == (32 if not history else 6)


def test_expected_peak_counts_the_pages_freed_by_finishes():
  """Hand-computed: every earlier response had 20 tokens (page size 4, K = 0).

  Running A (prompt 4, 12 tokens generated, 5 pages) finishes within 8 more tokens
  and holds at most ceil(21 / 4) = 6 pages; newcomer B (prompt 4, 2 pages) holds up to
  ceil(21 / 4) = 6 pages at t = 16. The peak is at t = 4: A 6 + B ceil(9 / 4) = 3, i.e.
  9 pages, not the 12 of both at their largest. With A just started both peak at
  t = 16 (6 + 6). With no finished response yet B counts as running to its cap: 16."""
  def sched(history):
    reqs = [Request([1] * 4, i, max_new_tokens=60) for i in range(2)]
    return Scheduler(SchedulerConfig(), PagePool(1000, 4), num_slots=2, round_tokens=1,
                     requests=reqs, max_tokens=lambda r: 64, length_history=history)

  def peak(s, a_length, a_pages):
    a = SeqState(request=s.queue[0], max_tokens=64, tick=0, pages=list(range(a_pages)),
                 slot=0, length=a_length)
    s.running = {0: a}
    b = SeqState(request=s.queue[1], max_tokens=64, tick=1, length=4)
    return s.expected_peak(b, pages=2)

  assert peak(sched([20] * 10), a_length=16, a_pages=5) == 9
  assert peak(sched([20] * 10), a_length=4, a_pages=2) == 12
  s = sched([])
  assert s.expected_peak(SeqState(request=s.queue[1], max_tokens=64, tick=0, length=4),
                         pages=2) == 16


@pytest.mark.parametrize("policy", ["kv_aware", "naive"])
def test_reclaim_takes_back_unused_room_before_preempting(policy):
  """Page size 4, a full pool of 8 pages: A (length 8) holds 5 pages, room to 20 tokens;
  B (length 12) holds 3 and must grow for its next round. kv_aware takes A's last page
  (nothing written there: A's next round needs ceil(9 / 4) = 3) and preempts no one;
  naive offloads the newest, B."""
  reqs = [Request([1] * 4, i, max_new_tokens=60) for i in range(2)]
  s = Scheduler(SchedulerConfig(policy=policy), PagePool(8, 4), num_slots=2, round_tokens=1,
                requests=reqs, max_tokens=lambda r: 64)
  a = SeqState(request=reqs[0], max_tokens=64, tick=0, pages=s.pool.allocate(5), slot=0,
               length=8)
  b = SeqState(request=reqs[1], max_tokens=64, tick=1, pages=s.pool.allocate(3), slot=1,
               length=12)
  s.running = {0: a, 1: b}
  a_pages = list(a.pages)
  victims = s.plan_preemptions()
  if policy == "naive":
    assert victims == [(b, "offload")] and s.stats["reclaimed_pages"] == 0
    return
  assert victims == [] and s.stats["reclaimed_pages"] == 1
  assert a.pages == a_pages[:4] and s.pool.num_free == 1  # the tail page, back in the pool
  s.grow()
  assert len(b.pages) == 4 and s.pool.num_free == 0


@pytest.mark.parametrize("policy", ["kv_aware", "naive"])
def test_new_requests_fill_free_slots_while_a_preempted_sequence_waits(policy):
  """Page size 4, 12 pages: B runs with 8; preempted A (length 20) needs 7 to come back
  with its 8-token chunk, 4 are free. kv_aware starts queued C (3 pages) in the free
  slot meanwhile; naive keeps the slot empty until A fits."""
  reqs = [Request([1] * 4, i, max_new_tokens=60) for i in range(3)]
  s = Scheduler(SchedulerConfig(policy=policy, grow_tokens=8), PagePool(12, 4), num_slots=2,
                round_tokens=1, requests=reqs[2:], max_tokens=lambda r: 64)
  b = SeqState(request=reqs[1], max_tokens=64, tick=1, pages=s.pool.allocate(8), slot=0,
               length=28)
  s.running, s.free_slots = {0: b}, [1]
  a = SeqState(request=reqs[0], max_tokens=64, tick=0, length=20, mode="offload")
  s.preempted.append(a)
  assert s.restore_next() is None
  c = s.admit_next()
  if policy == "naive":
    assert c is None and s.stats["admission_waits"] == 1
    return
  assert c.request is reqs[2] and c.slot == 1 and len(c.pages) == 3
  assert list(s.preempted) == [a] and s.pool.num_free == 1


@pytest.mark.parametrize("policy", [
    "kv_aware", pytest.param("naive", marks=pytest.mark.slow)])
def test_schedule_replay_reproduces_the_engine(target, policy):
  """bench.schedule_replay drives the same Scheduler host-only from the response
  lengths: the same rounds, device calls, preemptions and bytes as the engine (AR),
  in a first call and in a second one that models lengths on the first's."""
  from spec_rl_jax.bench.schedule_replay import ReplayRequest, replay
  reqs = _requests(12, seed=4)
  engine = _engine(target, 24, SAMPLED, policy=policy, recompute_max_tokens=20)
  c = engine.config
  history = []
  for _ in range(2):
    res = engine.generate(reqs)
    m = res.metrics
    got = replay([ReplayRequest(r.prompt, r.request_id, len(out.tokens), r.max_new_tokens)
                  for r, out in zip(reqs, res.responses)], c.scheduler,
                 num_slots=c.num_slots, num_pages=c.num_pages, page_size=c.page_size,
                 max_new=40, round_budget=c.round_budget, history=history)
    assert m["preemptions"] > 0
    for k in ("rounds", "device_calls", "preemptions", "offloads", "recomputes",
              "reclaimed_pages", "admission_waits", "recompute_tokens"):
      assert got.get(k, 0) == m[k], k
    assert got["moved_pages"] * engine.page_bytes() == m["offload_bytes"] + m["restore_bytes"]
    assert got["slot_utilization"] == pytest.approx(m["slot_utilization"])
    history += list(got["finished_lengths"])


def _head_proposer(target, name):
  """A random Eagle3 head or two MTP modules for ``target``."""
  if name == "eagle3":
    head = eagle3.init_head(eagle3.Eagle3Config.for_policy(target.cfg, (1, 1, 1)), seed=5)
    return Eagle3Proposer(Eagle3ProposerConfig(), head, target)
  heads = mtp.init_heads(mtp.MTPConfig(2, target.cfg), seed=5)
  return MTPProposer(MTPProposerConfig(), heads, target)


@pytest.mark.parametrize("name,recompute", [
    pytest.param("eagle3", 10_000, marks=pytest.mark.slow),
    pytest.param("eagle3", 0, marks=pytest.mark.slow),
    pytest.param("mtp", 10_000, marks=pytest.mark.slow),
    pytest.param("mtp", 0, marks=pytest.mark.slow)])
def test_draft_heads_resume_their_state_after_preemption(target, name, recompute):
  """Draft heads keep per-slot rows and their own KV pools: a preempted sequence
  (recomputed, or offloaded) drafts exactly as it would have uninterrupted, so every
  draft is accepted or rejected as with room for all (same random draws per position)."""
  reqs = _requests(seed=4)
  free = _engine(target, 400, SAMPLED, K=2, proposer=_head_proposer(target, name))
  free = free.generate(reqs)
  tight = _engine(target, 26, SAMPLED, K=2, proposer=_head_proposer(target, name),
                  recompute_max_tokens=recompute, grow_tokens=16).generate(reqs)
  _same(free, tight)
  mode = "recomputes" if recompute else "offloads"
  assert tight.metrics[mode] == tight.metrics["preemptions"] > 0
  assert tight.metrics["accepted_tokens"] == free.metrics["accepted_tokens"] > 0
