"""Statistical exactness of speculative rollouts against adversarial drafters.

Tiny-vocab target (V = 8), 3-token continuations (the first from prefill, the next two
from speculative rounds with K = 2), the exact joint law enumerated by teacher forcing,
``n = 20k`` engine samples per case. Checks: chi-square at p = 0.001 (cells with
expected count < 5 pooled) and total variation below 1.5x its expected value under the
null (plus 0.005). A sampler that skips the residual correction fails both.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from spec_rl_jax.models.config import get_preset
from spec_rl_jax.models.kv_cache import ContiguousKVCache
from spec_rl_jax.models.transformer import init_decoder
from spec_rl_jax.rollout.engine import RolloutEngine
from spec_rl_jax.rollout.types import EngineConfig, Request
from spec_rl_jax.sampling import SamplingParams, process_logits
from spec_rl_jax.spec import verifier
from spec_rl_jax.spec.proposers import Proposer
from spec_rl_jax.spec.proposers.draft_model import DraftModelConfig, DraftModelProposer
from tests.stats import exact_joint, goodness_of_fit

V, N_SAMPLES, PROMPT = 8, 20_000, [3, 1, 4, 1, 5]


def _target():
  model = init_decoder(get_preset("tiny-qwen3", vocab_size=V), seed=11)
  nnx.update(model, jax.tree.map(lambda x: 2 * x, nnx.state(model, nnx.Param)))  # spread p
  return model


def _copy(model, scale_final_norm=1.0, zero_embed=False):
  m = nnx.merge(*nnx.split(model))
  m = nnx.merge(nnx.graphdef(m), jax.tree.map(jnp.copy, nnx.state(m)))
  m.final_norm.scale[...] = m.final_norm.scale[...] * scale_final_norm
  if zero_embed:  # tied head: logits are exactly 0, q is uniform
    m.embed[...] = jnp.zeros_like(m.embed[...])
  return m


@dataclasses.dataclass(frozen=True)
class ConstantConfig:
  token: int = 0


class ConstantProposer(Proposer):
  """Adversarial deterministic drafter: always proposes one (unlikely) token."""

  name = "constant"
  Config = ConstantConfig

  def propose(self, weights, state, ctx, num_draft, sampling):
    return (jnp.full((ctx.last.shape[0], num_draft), self.config.token, jnp.int32), None,
            state)


def _proposer(kind, target):
  if kind == "point_mass_unlikely":
    logits = target(jnp.asarray([PROMPT]), jnp.arange(len(PROMPT))[None]).logits[0, -1]
    return ConstantProposer(ConstantConfig(int(jnp.argmin(logits))))
  draft = {"uniform": lambda: _copy(target, zero_embed=True),
           "sharper": lambda: _copy(target, scale_final_norm=3.0),
           "q_equals_p": lambda: target}[kind]()
  return DraftModelProposer(DraftModelConfig(), draft)


def _fit(target, params, result) -> dict:
  return goodness_of_fit(exact_joint(target, PROMPT, params, 3),
                         [r.tokens for r in result.responses])


def _sample(target, proposer, params, n=N_SAMPLES):
  engine = RolloutEngine(target, EngineConfig(
      num_slots=256, page_size=8, num_pages=512, max_seq_len=16, max_new_tokens=3,
      min_prefill_len=8, sampling=params, max_draft_tokens=2), proposer=proposer)
  return engine.generate([Request(PROMPT, i) for i in range(n)])


# The default tier: a deterministic drafter (q = point mass) and a stochastic one with
# top-p (residual over a truncated support); the rest of the grid is slow.
FAST = [("sharper", 1.0, 0.9)]
ALL = [(k, t, tp) for k in ("uniform", "point_mass_unlikely", "sharper", "q_equals_p")
       for t in (0.7, 1.0) for tp in (1.0, 0.9)]


@pytest.fixture(scope="module")
def target():
  return _target()


def _check(target, kind, temperature, top_p):
  params = SamplingParams(temperature=temperature, top_p=top_p)
  res = _sample(target, _proposer(kind, target), params)
  fit = _fit(target, params, res)
  assert fit["chi2"] < fit["chi2_max"], (kind, fit)
  assert fit["tv"] < fit["tv_max"], (kind, fit)
  m = res.metrics
  assert m["drafted_tokens"] > 0
  if kind == "q_equals_p":
    assert m["accepted_tokens"] / m["drafted_tokens"] > 0.95
  elif kind in ("point_mass_unlikely", "uniform"):
    assert m["accepted_tokens"] < m["drafted_tokens"]


@pytest.mark.parametrize("kind,temperature,top_p", FAST)
def test_sd_distribution_exact(target, kind, temperature, top_p):
  _check(target, kind, temperature, top_p)


@pytest.mark.slow
@pytest.mark.parametrize("kind,temperature,top_p", [c for c in ALL if c not in FAST])
def test_sd_distribution_exact_full_grid(target, kind, temperature, top_p):
  _check(target, kind, temperature, top_p)


def test_broken_sampler_is_detected(target, monkeypatch):
  """Skipping the residual correction (resampling from p after a rejection) biases the
  output towards the drafts' rejected mass; both statistics must catch it."""
  monkeypatch.setattr(verifier, "residual_distribution", lambda p, q: p)
  params = SamplingParams(temperature=1.0)
  # A third of the exactness tests' samples: caught here, so caught there.
  res = _sample(target, _proposer("sharper", target), params, n=N_SAMPLES * 3 // 10)
  fit = _fit(target, params, res)
  assert fit["chi2"] > fit["chi2_max"] and fit["tv"] > fit["tv_max"], fit


def test_sd_logprobs_equal_teacher_forcing_and_rollback_leaves_exact_cache(target):
  """Sampled SD rollouts: returned logprobs equal a teacher-forced forward; after
  rejections the target and draft caches hold exactly the accepted tokens' KV."""
  params = SamplingParams(temperature=1.0)
  draft = _copy(target, scale_final_norm=3.0)
  proposer = DraftModelProposer(DraftModelConfig(), draft)
  engine = RolloutEngine(target, EngineConfig(
      num_slots=1, page_size=8, num_pages=8, max_seq_len=48, max_new_tokens=30,
      sampling=params, max_draft_tokens=3), proposer=proposer)
  res = engine.generate([Request(PROMPT, 0)])
  r = res.responses[0]
  assert 0 < res.metrics["accepted_tokens"] < res.metrics["drafted_tokens"]  # rejections
  seq = PROMPT + r.tokens
  logits = target(jnp.asarray([seq]), jnp.arange(len(seq))[None]).logits[0]
  pred = logits[len(PROMPT) - 1:-1]
  toks = jnp.asarray(r.tokens)[:, None]
  np.testing.assert_allclose(r.policy_logprobs,
                             jnp.take_along_axis(jax.nn.log_softmax(pred), toks, 1)[:, 0],
                             atol=1e-4)
  np.testing.assert_allclose(r.logprobs, jnp.take_along_axis(
      process_logits(pred, params), toks, 1)[:, 0], atol=1e-4)

  # KV of every position whose token is committed: 0 .. len(seq) - 2 (the last emitted
  # token's KV is written by the next round, which never came). The draft catches up on
  # its newest position at the start of a round, so it is checked one position less.
  for model, pools, n in ((target, engine.state.cache.layers, len(seq) - 1),
                          (draft, engine.state.proposer.pools, len(seq) - 2)):
    ref = model(jnp.asarray([seq[:n]]), jnp.arange(n)[None],
                cache=ContiguousKVCache.init(model.cfg, 1, n)).cache
    k_pages = pools[0]  # [L, Hk, P, Ps, Dh]; one request: pages 0, 1, ... in order
    Ps = k_pages.shape[3]
    got = k_pages[:, :, : -(-n // Ps)].reshape(k_pages.shape[0], k_pages.shape[1], -1,
                                               k_pages.shape[-1])[:, :, :n]
    want = ref.layers[0][:, 0].transpose(0, 2, 1, 3)  # [L, Hk, n, Dh]
    np.testing.assert_allclose(got, want, atol=1e-5)
