"""The speculation protocol: hidden-state feedback, per-call draft length, drafters on
the mesh, weights handed over safely, the incremental generation API."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tokenizers
from flax import nnx

from spec_rl_jax import sharding
from spec_rl_jax.compiles import CompileCounter
from spec_rl_jax.models import layout
from spec_rl_jax.models.config import get_preset
from spec_rl_jax.models.tokenizer import Tokenizer
from spec_rl_jax.models.transformer import init_decoder
from spec_rl_jax.rollout.engine import RolloutEngine
from spec_rl_jax.rollout.types import EngineConfig, Request
from spec_rl_jax.sampling import SamplingParams
from spec_rl_jax.spec.controller import FixedK, SpecController
from spec_rl_jax.spec.proposers import Proposer, ProposerState, build_proposer
from spec_rl_jax.spec.proposers.draft_model import DraftModelConfig, DraftModelProposer

CFG = get_preset("tiny-qwen3")
V = CFG.vocab_size
GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(temperature=1.0, top_k=20)


def _peaked(seed, cfg=CFG, scale=10.0):
  """A random decoder with ``0.02 * scale``-std weights: prompt-dependent greedy
  continuations."""
  model = init_decoder(cfg, seed=seed)
  nnx.update(model, jax.tree.map(lambda x: scale * x, nnx.state(model, nnx.Param)))
  return model


@pytest.fixture(scope="module")
def policy():
  return _peaked(3)


def _requests(n, seed=0, offset=0):
  rng = np.random.default_rng(seed)
  base = rng.integers(1, V, 5).tolist()
  return [Request(base + rng.integers(1, V, rng.integers(1, 8)).tolist(), offset + i,
                  group_id=i % 3) for i in range(n)]


def _config(K, **kw):
  c = dict(num_slots=4, page_size=8, num_pages=64, max_seq_len=48, max_new_tokens=16,
           max_draft_tokens=K, eos_ids=(7,), sampling=GREEDY)
  c.update(kw)
  return EngineConfig(**c)


# --------------------------------------------------------------------------- feedback


@dataclasses.dataclass(frozen=True)
class RecorderConfig:
  layers: tuple[int, ...] = (0, 1)


class HiddenRecorder(Proposer):
  """Stores the declared layers' hidden states by position (prefill and observe) and
  drafts the last token again (a point mass)."""

  name = "recorder"
  Config = RecorderConfig

  def __init__(self, config, max_seq_len):
    super().__init__(config)
    self.hidden_layers = config.layers
    self.max_seq_len = max_seq_len

  def init_state(self, engine_config):
    S, h = engine_config.num_slots, len(self.hidden_layers)
    return ProposerState(rows={"seen": jnp.zeros((S, self.max_seq_len, h, CFG.embed_dim))})

  def _write(self, state, slots, positions, hidden, keep):
    """``hidden [h, n, T, D]`` at ``positions [n, T]`` of rows ``slots [n]``."""
    pos = jnp.where(keep, positions, self.max_seq_len)  # out of range: dropped
    seen = state.rows["seen"].at[slots[:, None], pos].set(hidden.transpose(1, 2, 0, 3),
                                                          mode="drop")
    return state.replace(rows={"seen": seen})

  def prefill(self, weights, state, batch):
    return self._write(state, batch.slots, batch.positions, batch.hidden,
                       batch.positions >= 0)

  def observe(self, weights, state, fb):
    S, k1 = fb.inputs.shape
    keep = jnp.arange(k1)[None, :] < fb.num_emitted[:, None]
    return self._write(state, jnp.arange(S), fb.positions, fb.hidden, keep)

  def propose(self, weights, state, ctx, num_draft, sampling):
    return jnp.repeat(ctx.last[:, None], num_draft, 1), None, state


def test_verification_returns_the_declared_hidden_states():
  """Prefill and every round's verification hand the proposer the hidden states of its
  layers; what it keeps (accepted positions only) equals a teacher-forced forward.
  (A small-weight random policy repeats tokens, so repeated drafts are often accepted.)"""
  L, policy = CFG.num_layers, init_decoder(CFG, seed=0)
  rec = HiddenRecorder(RecorderConfig((0, L - 1)), 48)
  engine = RolloutEngine(policy, _config(3, num_slots=1, eos_ids=()), proposer=rec)
  req = Request([5, 9, 14, 3, 3, 3, 8], 0)
  res = engine.generate([req])
  r = res.responses[0]
  assert res.metrics["accepted_tokens"] > 0 and len(r.tokens) == 16
  seq = req.prompt + r.tokens
  n = len(seq) - 1  # the last emitted token is never verified
  ref = policy(jnp.asarray([seq]), jnp.arange(len(seq))[None], hidden_layers=(0, L - 1))
  want = np.asarray(ref.hidden[:, 0, :n]).transpose(1, 0, 2)  # [n, h, D]
  got = np.asarray(engine.state.proposer.rows["seen"][0, :n])
  np.testing.assert_allclose(got, want, atol=1e-4)


def test_bad_proposer_setups_are_rejected(policy):
  with pytest.raises(ValueError, match="hidden layers"):
    RolloutEngine(policy, _config(2), proposer=HiddenRecorder(RecorderConfig((0, 9)), 48))
  with pytest.raises(ValueError, match="k=3 outside"):
    FixedK(2, 3)
  with pytest.raises(ValueError, match="controller max_draft_tokens"):
    RolloutEngine(policy, _config(2), proposer=build_proposer("ngram", policy),
                  controller=FixedK(3))
  with pytest.raises(TypeError, match="NGramConfig"):
    build_proposer("ngram", policy, config=DraftModelConfig())


# --------------------------------------------------------------------------- draft length


class Cycle(SpecController):
  """Draft lengths in a fixed cycle, one per decode call."""

  def __init__(self, max_draft_tokens, ks):
    super().__init__(max_draft_tokens)
    self.ks, self.calls = ks, 0

  def choose(self, shape):
    self.calls += 1
    return self.ks[(self.calls - 1) % len(self.ks)]


def test_per_call_draft_length_keeps_greedy_exact_and_compiles_per_k(policy):
  """k changes every call (round budget 2): greedy SD still equals AR; the draft model,
  which skipped the k = 0 calls, is re-prefilled and then accepts every draft of an
  identical copy of the policy (a stale cache would not); one decode program per
  (k, S_c, M_c), none compiled again on a second run."""
  reqs = _requests(6)
  ar = RolloutEngine(policy, _config(0, round_budget=2)).generate(reqs)
  copy = nnx.merge(nnx.graphdef(policy), nnx.state(policy))
  engine = RolloutEngine(policy, _config(3, round_budget=2),
                         proposer=DraftModelProposer(DraftModelConfig(), copy),
                         controller=Cycle(3, [3, 0, 1, 0, 2]))
  sd = engine.generate(reqs)
  assert [r.tokens for r in sd.responses] == [r.tokens for r in ar.responses]
  m = sd.metrics
  assert set(m["rounds_at_k"]) == {0, 1, 2, 3} and m["resyncs"] > 0
  assert m["accepted_tokens"] == m["drafted_tokens"] > 0
  assert len(m["acceptance_at"]) == 3
  assert engine.programs.decode._cache_size() == len(engine.decode_shapes)
  assert {k for k, _, _ in engine.decode_shapes} == {0, 1, 2, 3}
  with CompileCounter() as again:
    engine.controller.calls = 0
    second = engine.generate(_requests(6, offset=100))
  assert again.count == 0
  assert [r.tokens for r in second.responses] == [r.tokens for r in ar.responses]


# --------------------------------------------------------------------------- weights


def test_set_weights_copies_so_the_learner_may_donate(policy):
  """The engine keeps copies: donating the model's buffers (as the learner's update
  does) leaves the engine working; ``set_weights`` versions the tokens after it."""
  # Buffers of its own: the donations below must not reach the module's shared policy.
  model = nnx.merge(nnx.graphdef(policy), jax.tree.map(jnp.copy, nnx.state(policy)))
  engine = RolloutEngine(model, _config(0, num_slots=2, eos_ids=(), round_budget=4))
  reqs = _requests(2)
  before = engine.generate(reqs)
  donate = jax.jit(lambda s: jax.tree.map(lambda x: x * 1.5, s), donate_argnums=0)
  old = jax.tree.leaves(nnx.state(model))
  nnx.update(model, donate(nnx.state(model)))
  assert all(x.is_deleted() for x in old)  # the donation really happened
  again = engine.generate(_requests(2, offset=10))
  assert [r.tokens for r in again.responses] == [r.tokens for r in before.responses]

  engine.submit(_requests(2, offset=20))
  engine.step()
  assert engine.set_weights(model, version=7) == 7
  nnx.update(model, donate(nnx.state(model)))  # the new copies survive this too
  done = {r.request_id: r for r in engine.drain()}
  for r in done.values():
    v = r.policy_versions
    assert v.shape == (16,) and list(v[:5]) == [0] * 5 and list(v[5:]) == [7] * 11
    assert np.all(np.diff(v) >= 0)


@pytest.mark.slow
def test_stacked_layout_matches_the_cpu_layout():
  """The accelerator layout (stacked, scanned weights, no CPU compiler options) forced on
  CPU emits the same tokens, and logprobs to fp32 rounding (other dot kernels and
  summation orders), as the CPU per-layer layout. Std-0.04 weights, as on the mesh (see
  `mesh_policy`): the rounding of other summation orders grows with the logits' scale."""
  policy = _peaked(3, scale=2.0)
  reqs = _requests(5)
  cfg = _config(2, sampling=SAMPLED)
  runs = [RolloutEngine(policy, cfg, proposer=build_proposer("self_sparse", policy),
                        layout=lay).generate(reqs)
          for lay in (layout.CpuLayerCopies(), layout.StackedLayout())]
  a, b = runs
  assert [r.tokens for r in a.responses] == [r.tokens for r in b.responses]
  for x, y in zip(a.responses, b.responses):
    np.testing.assert_allclose(x.logprobs, y.logprobs, rtol=2e-5, atol=1e-5)


# --------------------------------------------------------------------------- sampling


@pytest.mark.slow
def test_per_request_temperature(policy):
  """Greedy and sampled requests share one engine: each gets the tokens and logprobs an
  engine with its sampling as the default gives; drafting reads each slot's temperature
  (greedy requests of a speculative engine equal greedy AR token for token)."""
  reqs = _requests(6)
  greedy = RolloutEngine(policy, _config(0)).generate(reqs).responses
  sampled = RolloutEngine(policy, _config(0, sampling=SAMPLED)).generate(reqs).responses
  mixed = [dataclasses.replace(r, sampling=GREEDY if i % 2 else None)
           for i, r in enumerate(reqs)]
  draft = _peaked(4, CFG.replace(num_layers=1))
  for K, proposer in ((0, None), (3, DraftModelProposer(DraftModelConfig(), draft))):
    out = RolloutEngine(policy, _config(K, sampling=SAMPLED), proposer=proposer
                        ).generate(mixed).responses
    for i, r in enumerate(out):
      want = greedy[i] if i % 2 else sampled[i]
      if i % 2 or not K:  # sampled SD draws other numbers than AR: equal in law only
        assert r.tokens == want.tokens
        np.testing.assert_allclose(r.policy_logprobs, want.policy_logprobs, atol=1e-4)
      if i % 2:
        assert np.all(r.logprobs == 0.0)  # a point mass on the greedy token
  engine = RolloutEngine(policy, _config(0, sampling=SAMPLED))
  with pytest.raises(ValueError, match="only the temperature may vary"):
    engine.submit([Request([1, 2], 0, sampling=SamplingParams(1.0, top_k=5))])
  assert not engine.busy()


# --------------------------------------------------------------------------- streaming


def _word_tokenizer():
  words = [f"w{i}" for i in range(V)]
  backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(
      {w: i for i, w in enumerate(words)}, unk_token="w0"))
  backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
  backend.decoder = tokenizers.decoders.WordPiece(prefix="##")  # joins words with spaces
  return Tokenizer(backend=backend, eos_ids=(7,), pad_id=0)


def test_incremental_api_matches_generate(policy):
  """submit + step deltas rebuild every response of generate; stream_text yields the
  text of one request piece by piece."""
  tok = _word_tokenizer()
  reqs = _requests(7, seed=2)
  cfg = _config(2, sampling=SAMPLED, round_budget=3)
  ref = RolloutEngine(policy, cfg, proposer=build_proposer("ngram", policy)).generate(reqs)
  engine = RolloutEngine(policy, cfg, tok, proposer=build_proposer("ngram", policy))
  engine.submit(reqs)
  got, finish, steps = {r.request_id: [] for r in reqs}, {}, 0
  while engine.busy():
    steps += 1
    for d in engine.step():
      got[d.request_id] += d.tokens
      if d.finish_reason != "running":
        finish[d.request_id] = d.finish_reason
  assert steps > 2 and len(engine.drain()) == len(reqs)
  for r in ref.responses:
    assert got[r.request_id] == r.tokens and finish[r.request_id] == r.finish_reason

  prompt = "w5 w9 w14 w3 w3"
  pieces = list(engine.stream_text(prompt, request_id=500))
  (text, _), = engine.generate_text([prompt], first_request_id=500)
  assert len(pieces) > 1 and "".join(pieces).strip() == text.strip()


# --------------------------------------------------------------------------- mesh


# No top-k here: a near-tie at the k-th logit can flip under rounding and renormalise.
PLAIN = SamplingParams(temperature=1.0)


def _proposers(policy, draft):
  return {"draft_model": lambda: DraftModelProposer(DraftModelConfig(), draft),
          "ngram": lambda: build_proposer("ngram", policy, reference_len=32),
          "self_sparse": lambda: build_proposer("self_sparse", policy, budget=0.5)}


@pytest.fixture(scope="module")
def mesh_policy():
  """Std-0.04 weights (mean -log p 4.7 nats of 6.2): tensor-parallel sums add partial
  products in another order, and that fp32 rounding grows with the logits' scale
  (max |Δ log p| 4e-6 here; 4e-5 at std 0.08, 4e-4 at std 0.2). Data-parallel meshes
  do not reorder sums."""
  return _peaked(3, scale=2.0)


@pytest.fixture(scope="module")
def single_device_runs(mesh_policy):
  """(draft, requests, run): ``run(name)`` is the single-device sampled run of proposer
  ``name`` (``None``: greedy AR), made when a test first asks for it."""
  policy, draft = mesh_policy, _peaked(4, CFG.replace(num_layers=1), scale=2.0)
  reqs = _requests(6, seed=5)

  @functools.cache
  def run(name):
    if name is None:
      return RolloutEngine(policy, _config(0)).generate(reqs)
    return RolloutEngine(policy, _config(3, sampling=PLAIN),
                         proposer=_proposers(policy, draft)[name]()).generate(reqs)

  return draft, reqs, run


MESHES = [pytest.param((1, 2, 2), id="1x2x2"),
          pytest.param((1, 1, 1), id="1x1x1", marks=pytest.mark.slow),
          pytest.param((2, 1, 1), id="2x1x1", marks=pytest.mark.slow),
          pytest.param((1, 1, 2), id="1x1x2", marks=pytest.mark.slow)]


@pytest.mark.mesh
@pytest.mark.parametrize("mesh_shape", MESHES)
@pytest.mark.parametrize("name", ["draft_model", pytest.param("ngram", marks=pytest.mark.slow),
                                  pytest.param("self_sparse", marks=pytest.mark.slow)])
def test_drafters_on_the_mesh(mesh_policy, single_device_runs, mesh_shape, name):
  """Policy, drafter weights and every KV pool sharded on the mesh: greedy SD equals
  greedy AR; sampled tokens equal the single-device run's, logprobs within 1e-5 (see
  `mesh_policy`)."""
  draft, reqs, ref = single_device_runs
  policy, mesh = mesh_policy, sharding.make_mesh(mesh_shape)
  on_mesh = nnx.merge(nnx.graphdef(policy), sharding.device_put_state(nnx.state(policy), mesh))
  for sampling in (GREEDY, PLAIN):
    engine = RolloutEngine(on_mesh, _config(3, sampling=sampling),
                           proposer=_proposers(on_mesh, draft)[name]())
    if mesh_shape != (1, 1, 1):
      pools = jax.tree.leaves((engine.state.cache.layers, engine.state.proposer.pools))
      assert all(x.sharding.mesh == mesh for x in pools)
    out = engine.generate(reqs)
    want = ref(None if sampling is GREEDY else name)
    assert [r.tokens for r in out.responses] == [r.tokens for r in want.responses]
    if sampling is PLAIN:
      for x, y in zip(out.responses, want.responses):
        np.testing.assert_allclose(x.logprobs, y.logprobs, rtol=0, atol=1e-5)
        np.testing.assert_allclose(x.policy_logprobs, y.policy_logprobs, rtol=0, atol=1e-5)


@pytest.mark.mesh
def test_an_engine_on_devices_of_its_own(mesh_policy, single_device_runs):
  """Placement on disjoint sub-meshes: the policy on devices 0-3, the drafter on 4-5,
  the engine on a (1, 2, 2) mesh over devices 4-7. The engine keeps its pools (and its
  weight copies) there and generates what the single-device engine does."""
  draft, reqs, ref = single_device_runs
  devices = jax.devices()
  learner_mesh = sharding.make_mesh((1, 2, 2), devices[:4])
  engine_mesh = sharding.make_mesh((1, 2, 2), devices[4:])
  place = lambda m, mesh: nnx.merge(  # noqa: E731
      nnx.graphdef(m), sharding.device_put_state(nnx.state(m), mesh))
  policy = place(mesh_policy, learner_mesh)
  drafter = place(draft, sharding.make_mesh((1, 1, 2), devices[4:6]))
  for sampling in (GREEDY, PLAIN):
    engine = RolloutEngine(policy, _config(3, sampling=sampling), mesh=engine_mesh,
                           proposer=DraftModelProposer(DraftModelConfig(), drafter))
    pools = jax.tree.leaves((engine.state.cache.layers, engine.state.proposer.pools))
    assert all(x.sharding.mesh == engine_mesh for x in pools)
    out = engine.generate(reqs)
    want = ref(None if sampling is GREEDY else "draft_model")
    assert [r.tokens for r in out.responses] == [r.tokens for r in want.responses]
    if sampling is PLAIN:
      for x, y in zip(out.responses, want.responses):
        np.testing.assert_allclose(x.policy_logprobs, y.policy_logprobs, rtol=0, atol=1e-5)
