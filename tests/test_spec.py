"""Speculative decoding is lossless: greedy equality and exact sampling distributions,
for every proposer, through the rollout engine."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tokenizers
from flax import nnx

from spec_rl_jax.models import hf_io
from spec_rl_jax.models.tokenizer import Tokenizer
from spec_rl_jax.rollout.engine import RolloutEngine
from spec_rl_jax.rollout.types import EngineConfig, Request
from spec_rl_jax.sampling import SamplingParams, process_logits
from spec_rl_jax.spec.proposers import build_proposer
from spec_rl_jax.spec.proposers.draft_model import (DraftModelConfig, DraftModelProposer,
                                                    check_tokenizers_match)
from spec_rl_jax.spec.verifier import verify
from tests import hf_fixtures

V = 96


def chi2_quantile(df: int, z: float = 3.09) -> float:
  """Wilson–Hilferty approximation of the chi-square quantile (z=3.09: p = 0.001)."""
  return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2_stat(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
  """Chi-square over cells with expected count >= 5 (the rest pooled into one cell)."""
  n = counts.sum()
  exp = n * probs
  big = exp >= 5
  obs_cells = list(counts[big]) + [counts[~big].sum()]
  exp_cells = list(exp[big]) + [exp[~big].sum()]
  stat = sum((o - e) ** 2 / e for o, e in zip(obs_cells, exp_cells) if e > 0)
  return stat, len([e for e in exp_cells if e > 0]) - 1


# --------------------------------------------------------------------------- verifier


@pytest.mark.parametrize("point_mass", [False, True], ids=["full_q", "point_mass"])
def test_verifier_position_marginals_are_target(point_mass):
  """Token at position j, given the first j drafts were accepted, follows p_j."""
  K, Vs, n = 3, 6, 40_000
  rng = np.random.default_rng(0)
  target = jnp.asarray(rng.normal(size=(K + 1, Vs)) * 1.5, jnp.float32)
  draft = jnp.asarray(rng.normal(size=(K, Vs)) * 1.5, jnp.float32)
  params = SamplingParams(temperature=1.0)
  q_lp = process_logits(draft, params)

  def one(key):
    kd, kv = jax.random.split(key)
    x = jax.random.categorical(kd, q_lp)  # [K]
    if point_mass:  # a deterministic drafter: fixed draft tokens
      x = jnp.asarray([1, 4, 2])
    v = verify(kv[None], x[None], None if point_mass else q_lp[None], target[None], params)
    return v.tokens[0], v.num_emitted[0]

  toks, n_emit = jax.vmap(one)(jax.random.split(jax.random.key(1), n))
  toks, n_emit = np.asarray(toks), np.asarray(n_emit)
  p = np.exp(np.asarray(process_logits(target, params)))
  for j in range(K + 1):
    sel = n_emit > j  # positions 0..j-1 accepted, position j emitted
    if sel.sum() < 500:
      continue
    counts = np.bincount(toks[sel, j], minlength=Vs)
    stat, df = chi2_stat(counts, p[j])
    assert stat < chi2_quantile(df), (j, stat, df)


def test_verifier_greedy_accepts_iff_argmax():
  target = jnp.asarray([[[0.0, 3.0, 1.0], [2.0, 0.0, 0.0], [0.0, 0.0, 5.0]]])  # argmax 1,0,2
  g = SamplingParams(temperature=0.0)
  v = verify(jax.random.key(0)[None], jnp.asarray([[1, 2]]), None, target, g)
  assert v.tokens.tolist() == [[1, 0, 0]] and v.num_emitted.tolist() == [2]
  v = verify(jax.random.key(0)[None], jnp.asarray([[1, 0]]), None, target, g)
  assert v.tokens.tolist() == [[1, 0, 2]] and v.num_emitted.tolist() == [3]
  assert v.accepted.tolist() == [[True, True]]


# --------------------------------------------------------------------------- engine


@pytest.fixture(scope="module")
def models(tmp_path_factory):
  d = str(tmp_path_factory.mktemp("target"))
  hf_fixtures.build("qwen3", d, tie=True, seed=1)
  target, _ = hf_io.load_hf_checkpoint(d)
  # A draft that agrees with the target often but not always: perturbed weights.
  draft, _ = hf_io.load_hf_checkpoint(d)
  noise = jax.tree.map(lambda x: x + 0.08 * jax.random.normal(jax.random.key(5), x.shape),
                       nnx.state(draft, nnx.Param))
  nnx.update(draft, noise)
  return target, draft


def _proposer(kind, draft):
  return (DraftModelProposer(DraftModelConfig(), draft) if kind == "draft_model"
          else build_proposer("ngram", draft, max_ngram=3, reference_len=64))


def _engine(target, proposer, K, slots, **kw):
  cfg = dict(num_slots=slots, page_size=8, num_pages=160, max_seq_len=96, max_new_tokens=24,
             max_draft_tokens=K)
  cfg.update(kw)
  return RolloutEngine(target, EngineConfig(**cfg), proposer=proposer)


def _prompts(n, seed):
  rng = np.random.default_rng(seed)
  base = rng.integers(1, V, 6).tolist()  # shared motifs give the n-gram drafter matches
  return [(base * 3)[: rng.integers(3, 18)] + rng.integers(1, V, rng.integers(1, 12)).tolist()
          for _ in range(n)]


GREEDY = SamplingParams(temperature=0.0)
GREEDY_REQS = [Request(p, i, group_id=i % 3) for i, p in enumerate(_prompts(9, seed=1))]


@pytest.fixture(scope="module")
def greedy_ar(models):
  return _engine(models[0], None, 0, 4, sampling=GREEDY, eos_ids=(11,)).generate(GREEDY_REQS)


@pytest.mark.parametrize("kind", ["draft_model", "ngram"])
@pytest.mark.parametrize("K", [1, 3])
def test_greedy_sd_equals_greedy_ar(models, greedy_ar, kind, K):
  target, draft = models
  ar = greedy_ar
  sd = _engine(target, _proposer(kind, draft), K, 4, sampling=GREEDY,
               eos_ids=(11,)).generate(GREEDY_REQS)
  assert [r.tokens for r in sd.responses] == [r.tokens for r in ar.responses]
  for a, b in zip(ar.responses, sd.responses):
    assert a.finish_reason == b.finish_reason
    np.testing.assert_allclose(a.policy_logprobs, b.policy_logprobs, atol=1e-4)
  m = sd.metrics
  assert m["drafted_tokens"] == K * m["slot_rounds"] > 0
  assert 0 < m["accepted_tokens"] <= m["drafted_tokens"]
  assert 1.0 < m["acceptance_length"] <= K + 1 and len(m["acceptance_at"]) == K
  assert m["slot_rounds"] < ar.metrics["slot_rounds"]  # fewer target forwards per token
  assert m["rounds_at_k"] == {K: m["rounds"]} and ar.metrics["rounds_at_k"] == {
      0: ar.metrics["rounds"]}


def _exact_joint(target, prompt, params, depth):
  """{token tuple: probability} of the first ``depth`` tokens, by teacher forcing."""
  out = {(): 1.0}
  for _ in range(depth):
    nxt = {}
    for prefix, pr in out.items():
      seq = jnp.asarray([prompt + list(prefix)])
      logits = target(seq, jnp.arange(seq.shape[1])[None]).logits[0, -1]
      p = np.exp(np.asarray(process_logits(logits, params), np.float64))
      for t in np.flatnonzero(p > 0):
        nxt[prefix + (int(t),)] = pr * p[t]
    out = nxt
  return out


def test_ngram_sampling_distribution_is_exact(models):
  """Joint law of the first 3 tokens under n-gram SD (K=2) equals the target's
  (chi-square); the draft-model drafters are covered in test_spec_exactness.py."""
  target, draft = models
  params = SamplingParams(temperature=1.0, top_k=3)
  prompt = [5, 17, 3, 44, 5, 17, 3]
  engine = _engine(target, build_proposer("ngram", target, max_ngram=3), 2, 32,
                   sampling=params, max_new_tokens=3)
  n = 4000
  res = engine.generate([Request(prompt, i, group_id=0) for i in range(n)])
  exact = _exact_joint(target, prompt, params, 3)
  cells = sorted(exact)
  index = {c: i for i, c in enumerate(cells)}
  counts = np.zeros(len(cells))
  for r in res.responses:
    assert tuple(r.tokens) in index, r.tokens  # never outside the target's support
    counts[index[tuple(r.tokens)]] += 1
  stat, df = chi2_stat(counts, np.asarray([exact[c] for c in cells]))
  assert stat < chi2_quantile(df), (stat, df)
  assert 0 < res.metrics["accepted_tokens"] < res.metrics["drafted_tokens"]


def test_ngram_uses_siblings_and_earlier_rollouts(models):
  """Greedy siblings are identical: once one finished, the others copy it (and a later
  call copies the stored rollout) — high acceptance, same tokens."""
  target, _ = models
  greedy = SamplingParams(temperature=0.0)
  engine = _engine(target, build_proposer("ngram", target, reference_len=64), 4, 1,
                   sampling=greedy)
  prompt = [9, 8, 7, 6, 5]
  first = engine.generate([Request(prompt, i, group_id=0) for i in range(3)])
  again = engine.generate([Request(prompt, 10)])
  toks = first.responses[0].tokens
  assert all(r.tokens == toks for r in first.responses + again.responses)
  assert again.metrics["acceptance_length"] > 4.0  # K + 1 = 5 at most
  assert first.metrics["acceptance_length"] > 2.0


def test_draft_tokenizer_mismatch_is_rejected():
  def tok(words):
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(
        {w: i for i, w in enumerate(words)}, unk_token=words[0]))
    return Tokenizer(backend=backend, eos_ids=(0,), pad_id=0)

  check_tokenizers_match(tok(["<e>", "a", "b"]), tok(["<e>", "a", "b"]))
  with pytest.raises(ValueError, match="does not match"):
    check_tokenizers_match(tok(["<e>", "a", "b"]), tok(["<e>", "b", "a"]))


def test_engine_rejects_mismatched_proposer_setup(models):
  target, draft = models
  with pytest.raises(ValueError, match="needs a proposer"):
    _engine(target, None, 2, 2)
  small_vocab = DraftModelProposer(DraftModelConfig(), nnx.merge(*nnx.split(draft)))
  small_vocab.model_config = small_vocab.model_config.replace(vocab_size=V + 1)
  with pytest.raises(ValueError, match="vocab_size"):
    _engine(target, small_vocab, 2, 2)
  with pytest.raises(ValueError, match="unknown proposer"):
    build_proposer("oracle", target)
  with pytest.raises(ValueError, match="max_ngrm"):
    build_proposer("ngram", target, max_ngrm=3)


def test_ngram_proposals_by_hand():
  """Own history, a sibling's history and the reference each supply the continuation."""
  from spec_rl_jax.spec.proposers.base import DraftContext, ProposerState
  hist = np.zeros((4, 12), np.int32)
  hist[0, :8] = [1, 2, 3, 9, 8, 1, 2, 3]  # own: suffix 1 2 3 seen at 0..2 -> 9 8 1
  hist[1, :4] = [7, 5, 6, 4]  # no own match for "6 4"; sibling slot 2 has "6 4 11 12 13"
  hist[2, :7] = [5, 6, 4, 11, 12, 13, 0]
  hist[3, :3] = [40, 41, 42]  # only the reference has "41 42 ..."
  ref = np.full((4, 10), -1, np.int32)
  ref[3, :6] = [41, 42, 43, 44, 45, 46]
  ctx = DraftContext(
      last=jnp.asarray(hist[np.arange(4), [7, 3, 6, 2]]), length=jnp.asarray([7, 3, 6, 2]),
      active=jnp.ones(4, bool), rid=jnp.arange(4), group=jnp.asarray([0, 1, 1, 2]),
      history=jnp.asarray(hist), page_table=jnp.zeros((4, 1), jnp.int32),
      key=jax.random.key(0), temperature=jnp.zeros(4), target_weights=None, cache=None)
  ngram = build_proposer("ngram", None, max_ngram=3, reference_len=10)
  state = ProposerState(rows={"reference": jnp.asarray(ref)})
  drafts, q, _ = ngram.propose(None, state, ctx, 3, GREEDY)
  assert q is None
  assert drafts[0].tolist() == [9, 8, 1]
  assert drafts[1].tolist() == [11, 12, 13]
  assert drafts[3].tolist() == [43, 44, 45]
