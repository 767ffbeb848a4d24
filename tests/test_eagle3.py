"""The ``eagle3`` proposer: drafting equals Eagle3's training-time test (so a head trained
by it drafts what it learned), greedy and sampled speculative rollouts are exact, and
heads made for another policy are refused."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from spec_rl_jax.models import eagle3
from spec_rl_jax.models.config import get_preset
from spec_rl_jax.models.transformer import Weights, init_decoder
from spec_rl_jax.rollout.engine import RolloutEngine
from spec_rl_jax.rollout.types import EngineConfig, Request
from spec_rl_jax.sampling import SamplingParams
from spec_rl_jax.spec import verifier
from spec_rl_jax.spec.proposers import DraftContext, Feedback, PrefillBatch
from spec_rl_jax.spec.proposers.eagle3 import Eagle3Proposer, Eagle3ProposerConfig
from tests import test_spec_exactness as exactness

V = 16
CFG = get_preset("tiny-qwen3", vocab_size=V, num_layers=4)


def _scaled(module, scale):
  """``module`` with its parameters times ``scale`` (peaked distributions)."""
  nnx.update(module, jax.tree.map(lambda x: scale * x, nnx.state(module, nnx.Param)))
  return module


@pytest.fixture(scope="module")
def policy():
  return _scaled(init_decoder(CFG, seed=3), 4.0)


def _head(policy_cfg, seed=0, scale=8.0, **kw):
  head = eagle3.init_head(eagle3.Eagle3Config.for_policy(policy_cfg, **kw), seed=seed)
  return _scaled(head, scale)


def _policy_out(policy, tokens, layers):
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
  return policy(tokens, positions, hidden_layers=layers)


def test_drafting_equals_the_training_time_test(policy):
  """Draft ``s`` of a round at ``length = p`` (after prefill, and after an observe that
  accepted one draft and corrected the next) has the logits of training-time-test step
  ``s`` at ``p + s`` on the same tokens."""
  head = _head(CFG, feature_layers=(1, 2, 3))
  prop = Eagle3Proposer(Eagle3ProposerConfig(), head, policy)
  pw, hw = Weights(nnx.state(policy), None), Weights(nnx.state(head), None)
  S, T, K, ps = 2, 6, 3, 4
  ec = EngineConfig(num_slots=S, page_size=ps, num_pages=16, max_seq_len=32,
                    max_new_tokens=16, max_draft_tokens=K)
  state = prop.init_state(ec)
  pages = jnp.arange(S * 8).reshape(S, 8)
  rng = np.random.default_rng(0)
  prompt = jnp.asarray(rng.integers(1, V, (S, T)), jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(T), (S, T))
  hidden = _policy_out(policy, prompt, prop.hidden_layers).hidden
  state = prop.prefill(hw, state, PrefillBatch(jnp.arange(S), prompt, positions, pages, hidden,
                                               pw))
  sampling = SamplingParams(temperature=1.0)

  def draft(state, seq, length, key):
    ctx = DraftContext(last=seq[:, length], length=jnp.full((S,), length), active=jnp.ones(
        (S,), bool), rid=jnp.arange(S), group=jnp.arange(S), history=seq, page_table=pages,
        key=jax.random.key(key), temperature=jnp.ones((S,)), target_weights=pw, cache=None)
    return prop.propose(hw, state, ctx, K, sampling)

  def check(seq, length, drafts, lp):
    full = jnp.concatenate([seq[:, :length + 1], drafts[:, :K - 1]], 1)
    out = _policy_out(policy, full, prop.hidden_layers)
    e = jnp.take(policy.embed[...], full, axis=0)
    ttt = eagle3.training_time_test(head, e, out.hidden, jnp.ones(full.shape, bool), K)
    for s in range(K):  # the draft vocabulary is the policy's: the same ids
      np.testing.assert_allclose(lp[:, s], jax.nn.log_softmax(ttt[s, :, length + s]),
                                 atol=2e-4, err_msg=f"draft {s}")

  last = jnp.asarray(rng.integers(1, V, (S, 1)), jnp.int32)
  seq = jnp.concatenate([prompt, last], 1)
  drafts, lp, state = draft(state, seq, T, 1)
  check(seq, T, drafts, lp)

  # Verification: draft 1 accepted, draft 2 replaced by a correction c (the new last).
  inputs = jnp.concatenate([last, drafts], 1)  # [S, K+1] at T..T+K
  c = (drafts[:, 1] + 1) % V
  tokens = jnp.concatenate([drafts[:, :1], c[:, None], jnp.zeros((S, K - 1), jnp.int32)], 1)
  hid = _policy_out(policy, jnp.concatenate([prompt, inputs], 1), prop.hidden_layers).hidden
  fb = Feedback(inputs, T + jnp.broadcast_to(jnp.arange(K + 1), (S, K + 1)), tokens,
                jnp.full((S,), 2), hid[:, :, T:], pages, pw)
  state = prop.observe(hw, state, fb)
  seq = jnp.concatenate([prompt, last, drafts[:, :1], c[:, None]], 1)
  drafts, lp, state = draft(state, seq, T + 2, 2)
  check(seq, T + 2, drafts, lp)


def _engine(policy, proposer, K, **kw):
  cfg = dict(num_slots=4, page_size=8, num_pages=64, max_seq_len=48, max_new_tokens=16,
             max_draft_tokens=K, eos_ids=(7,), sampling=SamplingParams(temperature=0.0))
  cfg.update(kw)
  return RolloutEngine(policy, EngineConfig(**cfg), proposer=proposer)


@pytest.mark.parametrize("K", [1, pytest.param(3, marks=pytest.mark.slow)])
def test_greedy_sd_equals_greedy_ar(policy, K):
  rng = np.random.default_rng(1)
  reqs = [Request(rng.integers(1, V, rng.integers(3, 12)).tolist(), i) for i in range(7)]
  ar = RolloutEngine(policy, EngineConfig(
      num_slots=4, page_size=8, num_pages=64, max_seq_len=48, max_new_tokens=16, eos_ids=(7,),
      sampling=SamplingParams(temperature=0.0))).generate(reqs)
  prop = Eagle3Proposer(Eagle3ProposerConfig(), _head(CFG, scale=1.0), policy)
  sd = _engine(policy, prop, K).generate(reqs)
  assert [r.tokens for r in sd.responses] == [r.tokens for r in ar.responses]
  for a, b in zip(ar.responses, sd.responses):
    np.testing.assert_allclose(a.policy_logprobs, b.policy_logprobs, atol=1e-4)
  m = sd.metrics
  assert m["drafted_tokens"] == K * m["slot_rounds"] > 0
  assert 0 < m["accepted_tokens"] < m["drafted_tokens"]


def _exactness_proposer(target):
  head = eagle3.init_head(eagle3.Eagle3Config.for_policy(target.cfg, feature_layers=(1, 1, 1)),
                          seed=4)
  return Eagle3Proposer(Eagle3ProposerConfig(), _scaled(head, 20.0), target)


@pytest.mark.parametrize("temperature,top_k,top_p", [
    (1.0, 0, 0.9), pytest.param(1.0, 0, 1.0, marks=pytest.mark.slow),
    pytest.param(0.7, 5, 1.0, marks=pytest.mark.slow)])
def test_sampled_sd_is_exact(temperature, top_k, top_p):
  target = exactness._target()
  params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
  res = exactness._sample(target, _exactness_proposer(target), params)
  fit = exactness._fit(target, params, res)
  assert fit["chi2"] < fit["chi2_max"] and fit["tv"] < fit["tv_max"], fit
  m = res.metrics
  assert 0 < m["accepted_tokens"] < m["drafted_tokens"]


@pytest.mark.slow
def test_broken_sampler_is_detected_with_eagle3_drafts(monkeypatch):
  """The control for the test above: skipping the residual correction is caught."""
  monkeypatch.setattr(verifier, "residual_distribution", lambda p, q: p)
  target = exactness._target()
  params = SamplingParams(temperature=1.0)
  res = exactness._sample(target, _exactness_proposer(target), params,
                          n=exactness.N_SAMPLES * 3 // 10)
  fit = exactness._fit(target, params, res)
  assert fit["chi2"] > fit["chi2_max"] and fit["tv"] > fit["tv_max"], fit


def test_heads_for_another_policy_are_refused(policy):
  other = get_preset("tiny-qwen3", vocab_size=V, num_layers=4, embed_dim=32)
  with pytest.raises(ValueError, match="hidden size 32"):
    Eagle3Proposer(Eagle3ProposerConfig(), _head(other), policy)
  with pytest.raises(ValueError, match="layer count"):
    Eagle3Proposer(Eagle3ProposerConfig(), _head(get_preset("tiny-qwen3", vocab_size=V),
                                                  feature_layers=(1, 1, 1)), policy)
  with pytest.raises(ValueError, match="out of range"):
    eagle3.Eagle3Config.for_policy(CFG, feature_layers=(1, 2, 4))
  vocab = {f"t{i}": i for i in range(V)}
  head = eagle3.init_head(eagle3.Eagle3Config.for_policy(
      CFG, fingerprint=eagle3.policy_fingerprint(CFG, vocab)))
  Eagle3Proposer(Eagle3ProposerConfig(), head, policy, vocab)  # its own policy: accepted
  with pytest.raises(ValueError, match="fingerprint"):
    Eagle3Proposer(Eagle3ProposerConfig(), head, policy, {**vocab, "t0": 1, "t1": 0})
