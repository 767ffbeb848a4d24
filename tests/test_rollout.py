"""Rollout engine: parity with transformers, batch independence, exact logprobs, pages."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from spec_rl_jax.compiles import CompileCounter
from spec_rl_jax.models import hf_io
from spec_rl_jax.models.config import get_preset
from spec_rl_jax.models.transformer import init_decoder
from spec_rl_jax.rollout.engine import RolloutEngine
from spec_rl_jax.rollout.types import EngineConfig, Request
from spec_rl_jax.sampling import SamplingParams, process_logits
from tests import hf_fixtures


def _prompts(n, vocab, seed=0, lo=1, hi=40):
  rng = np.random.default_rng(seed)
  return [rng.integers(1, vocab, rng.integers(lo, hi)).tolist() for _ in range(n)]


@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory):
  d = str(tmp_path_factory.mktemp("qwen3"))
  hf = hf_fixtures.build("qwen3", d, tie=True, seed=1)
  model, _ = hf_io.load_hf_checkpoint(d, load_tokenizer=False)
  return hf, model


def test_greedy_continuous_batching_matches_transformers(hf_pair):
  hf, model = hf_pair
  prompts = _prompts(11, model.cfg.vocab_size, seed=3, lo=1, hi=50)
  max_new = 24

  def hf_greedy(p, eos):
    with torch.inference_mode():
      out = hf.generate(torch.as_tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                        do_sample=False, max_new_tokens=max_new, eos_token_id=eos,
                        pad_token_id=0)
    toks = out[0, len(p):].tolist()
    return toks[:toks.index(eos) + 1] if eos is not None and eos in toks else toks

  # An EOS id the model actually emits, so some responses stop early.
  counts = collections.Counter(t for p in prompts for t in hf_greedy(p, None)[1:])
  eos = counts.most_common(1)[0][0]
  ref = [hf_greedy(p, eos) for p in prompts]
  assert any(len(r) < max_new for r in ref) and any(len(r) == max_new for r in ref)

  engine = RolloutEngine(model, EngineConfig(
      num_slots=4, page_size=8, num_pages=40, max_seq_len=128, max_new_tokens=max_new,
      sampling=SamplingParams(temperature=0.0), eos_ids=(eos,)))
  out = engine.generate([Request(p, i) for i, p in enumerate(prompts)]).responses
  assert [o.tokens for o in out] == ref
  for o, r in zip(out, ref):
    assert o.finish_reason == ("eos" if r[-1] == eos and len(r) <= max_new and eos in r
                               else "length")
  assert engine.stats["prefills"] > 1  # slots were refilled


def _sampling_engine(model, slots, **kw):
  cfg = dict(num_slots=slots, page_size=8, num_pages=96, max_seq_len=96, max_new_tokens=20,
             sampling=SamplingParams(temperature=0.8, top_k=40, top_p=0.95), eos_ids=(7,),
             seed=1234)
  cfg.update(kw)
  return RolloutEngine(model, EngineConfig(**cfg))


def test_responses_independent_of_slot_count(hf_pair):
  _, model = hf_pair
  reqs = [Request(p, 100 + i) for i, p in enumerate(_prompts(10, model.cfg.vocab_size, seed=5))]
  a = _sampling_engine(model, 2).generate(reqs).responses
  b = _sampling_engine(model, 8).generate(reqs).responses
  assert [r.tokens for r in a] == [r.tokens for r in b]
  assert len({tuple(r.tokens) for r in a}) > 1  # really sampling
  for x, y in zip(a, b):
    np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-5)


def test_logprobs_match_teacher_forcing(hf_pair):
  _, model = hf_pair
  engine = _sampling_engine(model, 3)
  out = engine.generate([Request(p, i) for i, p in enumerate(_prompts(5, 96, seed=9))]).responses
  params = engine.config.sampling
  for r in out:
    seq = jnp.asarray([r.prompt + r.tokens], jnp.int32)
    logits = model(seq, jnp.arange(seq.shape[1])[None]).logits[0]
    pred = logits[len(r.prompt) - 1:-1]  # logits that produced each response token
    toks = jnp.asarray(r.tokens)
    raw = jnp.take_along_axis(jax.nn.log_softmax(pred), toks[:, None], 1)[:, 0]
    proc = jnp.take_along_axis(process_logits(pred, params), toks[:, None], 1)[:, 0]
    np.testing.assert_allclose(r.policy_logprobs, raw, atol=1e-4)
    np.testing.assert_allclose(r.logprobs, proc, atol=1e-4)
    assert np.all(np.isfinite(r.logprobs))  # sampled tokens are inside the top-k/top-p set


def test_engine_first_token_distribution(hf_pair):
  """Empirical first-token distribution over many requests vs the processed target."""
  _, model = hf_pair
  prompt = [5, 17, 3, 44]
  params = SamplingParams(temperature=1.3, top_k=12, top_p=0.9)
  engine = _sampling_engine(model, 16, sampling=params, max_new_tokens=1)
  n = 3000
  out = engine.generate([Request(prompt, i, max_new_tokens=1) for i in range(n)]).responses
  counts = np.bincount([r.tokens[0] for r in out], minlength=96)
  logits = model(jnp.asarray([prompt]), jnp.arange(4)[None]).logits[0, -1]
  p = np.exp(np.asarray(process_logits(logits, params)))
  assert counts[p == 0].sum() == 0  # nothing outside the top-k/top-p set
  tv = 0.5 * np.abs(counts / n - p).sum()
  # E[TV] for n=3000 over <= 12 categories is ~0.02; 0.05 is > 4 sigma away.
  assert tv < 0.05, tv


def test_pages_return_and_admission_waits(hf_pair):
  _, model = hf_pair
  # Each request needs ceil((prompt + 20) / 8) <= 8 pages; 12 pages fit only one at a time.
  engine = _sampling_engine(model, 4, num_pages=12, max_seq_len=64)
  reqs = [Request(p, i) for i, p in enumerate(_prompts(6, 96, seed=2, lo=20, hi=40))]
  result = engine.generate(reqs)
  assert len(result.responses) == 6 and result.metrics["admission_waits"] > 0
  assert engine.free_pages == 12
  with pytest.raises(ValueError, match="never fit"):
    _sampling_engine(model, 2, num_pages=3, max_seq_len=64).generate([Request([1] * 10, 0)])
  with pytest.raises(ValueError, match="exceeds max_seq_len"):
    engine.generate([Request([1] * 60, 0)])
  with pytest.raises(ValueError, match="unique"):
    engine.generate([Request([1], 0), Request([2], 0)])


def test_no_recompile_across_refills():
  model = init_decoder(get_preset("tiny-qwen3"), seed=0)
  engine = RolloutEngine(model, EngineConfig(num_slots=4, page_size=8, num_pages=64,
                                             max_seq_len=64, max_new_tokens=12))
  reqs = lambda off: [Request(p, off + i) for i, p in enumerate(_prompts(9, 128, seed=4, hi=15))]
  with CompileCounter() as warmup:
    engine.generate(reqs(0))
  with CompileCounter() as after:
    m = engine.generate(reqs(1000)).metrics
  assert warmup.count > 0 and after.count == 0
  assert warmup.seconds > 0 and after.seconds == 0  # bench.rl subtracts these seconds
  # The device loop's seconds (bench.spec's round costs) are part of the wall clock,
  # the prefills the rest.
  assert m["device_calls"] > 1 and 0 < m["decode_s"] < m["wall_s"]
