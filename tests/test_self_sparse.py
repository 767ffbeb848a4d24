"""Self-sparse speculative decoding (S³R) is lossless: greedy equality with AR, the exact
sampling distribution, and sparse = dense when the budget covers the context."""

import numpy as np
import pytest

from spec_rl_jax.rollout.types import Request
from spec_rl_jax.sampling import SamplingParams
from spec_rl_jax.spec.proposers.self_sparse import SelfSparseConfig, SelfSparseProposer
from spec_rl_jax.spec.proposers.self_sparse import PageBudget
from tests.spec_fixtures import GREEDY, GREEDY_REQS
from tests.spec_fixtures import engine as make_engine
from tests.stats import exact_joint, goodness_of_fit


@pytest.fixture(scope="module")
def target(spec_target):
  return spec_target


def _sparse(target, reselect=True, **budget):
  proposer = SelfSparseProposer(SelfSparseConfig(reselect=reselect), target)
  proposer.budget = PageBudget(**budget)  # a fixed page count: not a config option
  return proposer


@pytest.mark.parametrize("K,reselect", [(2, True),
                                        pytest.param(4, False, marks=pytest.mark.slow)])
def test_greedy_self_sparse_equals_ar(target, greedy_ar, K, reselect):
  """A tight budget (1 sink + 1 window page of 8 tokens, no top-k: a fraction of the
  context for most of the run), continuous batching with 9 requests in 4 slots."""
  sd = make_engine(target, _sparse(target, reselect, n_sink=1, n_window=1, pages=2), K, 4,
                   sampling=GREEDY, eos_ids=(11,)).generate(GREEDY_REQS)
  assert [r.tokens for r in sd.responses] == [r.tokens for r in greedy_ar.responses]
  for a, b in zip(greedy_ar.responses, sd.responses):
    assert a.finish_reason == b.finish_reason
    np.testing.assert_allclose(a.policy_logprobs, b.policy_logprobs, atol=1e-4)
  m = sd.metrics
  assert 0 < m["accepted_tokens"] < m["drafted_tokens"] == K * m["slot_rounds"]


@pytest.mark.parametrize("budget", [pytest.param(dict(n_sink=1, n_window=1, fraction=1.0),
                                                 marks=pytest.mark.slow),
                                    pytest.param(dict(n_sink=1, n_window=2, pages=12),
                                                 marks=pytest.mark.slow)],
                         ids=["fraction_1", "all_pages"])
def test_budget_covering_context_accepts_every_draft(target, greedy_ar, budget):
  """Sparse = dense: with every page selected the draft is the policy itself."""
  K = 3
  sd = make_engine(target, _sparse(target, **budget), K, 4, sampling=GREEDY,
                   eos_ids=(11,)).generate(GREEDY_REQS)
  assert [r.tokens for r in sd.responses] == [r.tokens for r in greedy_ar.responses]
  m = sd.metrics
  assert m["accepted_tokens"] == m["drafted_tokens"] > 0
  assert m["acceptance_length"] == K + 1


def test_self_sparse_sampling_distribution_is_exact(target):
  """Joint law of the first 3 tokens under self-sparse SD (K=2) on a 14-token prompt
  with 2-token pages and a 2-page budget (the drafts see 4 of 14+ positions) equals the
  target's exact law (chi-square at p = 0.001)."""
  params = SamplingParams(temperature=1.0, top_k=3)
  prompt = [5, 17, 3, 44, 5, 17, 3, 60, 2, 71, 33, 8, 19, 40]
  engine = make_engine(target, _sparse(target, n_sink=1, n_window=1, pages=2), 2, 32,
                       sampling=params, max_new_tokens=3, page_size=2,
                       num_pages=1200)
  res = engine.generate([Request(prompt, i) for i in range(4000)])
  fit = goodness_of_fit(exact_joint(target, prompt, params, 3),
                        [r.tokens for r in res.responses])
  assert fit["outside"] == 0 and fit["chi2"] < fit["chi2_max"], fit
  assert 0 < res.metrics["accepted_tokens"] < res.metrics["drafted_tokens"]


def test_page_budget_validation():
  with pytest.raises(ValueError, match="exactly one"):
    PageBudget(pages=4, fraction=0.5)
  with pytest.raises(ValueError, match="exactly one"):
    PageBudget()
  with pytest.raises(ValueError, match="fraction"):
    PageBudget(fraction=1.5)
  assert PageBudget(n_sink=1, n_window=2, fraction=0.25).size(64) == 16
  assert PageBudget(n_sink=1, n_window=2, fraction=0.01).size(64) == 3  # sinks + window
  assert PageBudget(n_sink=1, n_window=2, pages=100).size(64) == 64


def test_long_context_top_k_selection_greedy_equals_ar(target):
  """A long-context tiny config: 150-token prompts, 40 pages of 4 tokens, a 25% budget
  whose top-k part is chosen by the Quest score (selection reused per round)."""
  rng = np.random.default_rng(7)
  reqs = [Request(rng.integers(1, 96, 150).tolist(), i) for i in range(3)]
  kw = dict(sampling=GREEDY, eos_ids=(11,), page_size=4, num_pages=200, max_seq_len=192,
            max_new_tokens=32)
  ar = make_engine(target, None, 0, 2, **kw).generate(reqs)
  sd = make_engine(target, _sparse(target, reselect=False, n_sink=1, n_window=1,
                                   fraction=0.25), 3, 2, **kw).generate(reqs)
  assert [r.tokens for r in sd.responses] == [r.tokens for r in ar.responses]
  assert sd.metrics["accepted_tokens"] > 0
