"""Speculative decoding is lossless: greedy equality and exact sampling distributions,
for every proposer, through the rollout engine."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tokenizers
from flax import nnx

from spec_rl_jax.models.tokenizer import Tokenizer
from spec_rl_jax.rollout.types import Request
from spec_rl_jax.sampling import SamplingParams, process_logits
from spec_rl_jax.spec.proposers import build_proposer
from spec_rl_jax.spec.proposers.draft_model import (DraftModelConfig, DraftModelProposer,
                                                    check_tokenizers_match)
from spec_rl_jax.spec.verifier import verify
from tests.spec_fixtures import GREEDY, GREEDY_REQS, V
from tests.spec_fixtures import engine as make_engine
from tests.stats import chi2_quantile, chi2_stat, exact_joint, goodness_of_fit

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
def models(spec_target):
  target = spec_target
  # A draft that agrees with the target often but not always: perturbed weights.
  draft = nnx.clone(target)
  noise = jax.tree.map(lambda x: x + 0.08 * jax.random.normal(jax.random.key(5), x.shape),
                       nnx.state(draft, nnx.Param))
  nnx.update(draft, noise)
  return target, draft


def _proposer(kind, draft):
  return (DraftModelProposer(DraftModelConfig(), draft) if kind == "draft_model"
          else build_proposer("ngram", draft, max_ngram=3, reference_len=64))


@pytest.mark.parametrize("kind,K", [
    ("draft_model", 1), ("ngram", 3),
    pytest.param("draft_model", 3, marks=pytest.mark.slow),
    pytest.param("ngram", 1, marks=pytest.mark.slow)])
def test_greedy_sd_equals_greedy_ar(models, greedy_ar, kind, K):
  target, draft = models
  ar = greedy_ar
  sd = make_engine(target, _proposer(kind, draft), K, 4, sampling=GREEDY,
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


def test_ngram_sampling_distribution_is_exact(models):
  """Joint law of the first 3 tokens under n-gram SD (K=2) equals the target's
  (chi-square); the draft-model drafters are covered in test_spec_exactness.py."""
  target, draft = models
  params = SamplingParams(temperature=1.0, top_k=3)
  prompt = [5, 17, 3, 44, 5, 17, 3]
  engine = make_engine(target, build_proposer("ngram", target, max_ngram=3), 2, 32,
                       sampling=params, max_new_tokens=3)
  n = 4000
  res = engine.generate([Request(prompt, i, group_id=0) for i in range(n)])
  fit = goodness_of_fit(exact_joint(target, prompt, params, 3),
                        [r.tokens for r in res.responses])
  assert fit["outside"] == 0 and fit["chi2"] < fit["chi2_max"], fit
  assert 0 < res.metrics["accepted_tokens"] < res.metrics["drafted_tokens"]


def test_ngram_uses_siblings_and_earlier_rollouts(models):
  """Greedy siblings are identical: once one finished, the others copy it (and a later
  call copies the stored rollout) — high acceptance, same tokens."""
  target, _ = models
  greedy = SamplingParams(temperature=0.0)
  engine = make_engine(target, build_proposer("ngram", target, reference_len=64), 4, 1,
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
    make_engine(target, None, 2, 2)
  small_vocab = DraftModelProposer(DraftModelConfig(), nnx.merge(*nnx.split(draft)))
  small_vocab.model_config = small_vocab.model_config.replace(vocab_size=V + 1)
  with pytest.raises(ValueError, match="vocab_size"):
    make_engine(target, small_vocab, 2, 2)
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
