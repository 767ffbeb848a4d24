"""Evaluation: pass@k, the scoring path, draft acceptance and the CLI."""

import itertools
import json
import math

import numpy as np
import pytest

from spec_rl_jax import eval as evaluation
from spec_rl_jax.data import Source
from spec_rl_jax.models import hf_io
from spec_rl_jax.models.config import get_preset
from spec_rl_jax.models.transformer import init_decoder
from spec_rl_jax.tasks.bpe import default_tokenizer

TINY = get_preset("tiny-qwen3", vocab_size=512)


@pytest.fixture(scope="module")
def tok():
  return default_tokenizer()


@pytest.mark.parametrize("n,c,k", [(5, 0, 1), (5, 2, 1), (5, 2, 3), (6, 3, 6), (4, 4, 2)])
def test_pass_at_k_matches_enumeration(n, c, k):
  outcomes = [1] * c + [0] * (n - c)
  subsets = list(itertools.combinations(outcomes, k))
  assert evaluation.pass_at_k(n, c, k) == pytest.approx(np.mean([any(s) for s in subsets]))
  assert evaluation.pass_at_k(n, c, 1) == pytest.approx(c / n)


def _oracle(tok, records, correct):
  """A `generate` that answers each prompt with its reference iff ``correct(i, greedy)``."""
  by_prompt = {tuple(tok.encode(r["prompt"] + "\n")): r for r in records}
  counter = itertools.count()

  def generate(engine, prompts, max_new_tokens, temperature, first_id=0):
    out = []
    for p in prompts:
      r, i = by_prompt[tuple(p)], next(counter)
      text = r["answer"] if correct(i, temperature == 0) else "#### -1"
      out.append(tok.encode(text) + [tok.eos_ids[0]])
    return out

  return generate


def test_scores_follow_the_responses(tok, monkeypatch):
  source = Source.parse("task:arithmetic?max_digits=3")
  records = source.held_out(10, 0)
  # Greedy always right; sampled right on every other call (k=2: one of two per prompt).
  monkeypatch.setattr(evaluation, "generate",
                      _oracle(tok, records, lambda i, greedy: greedy or i % 2 == 0))
  out = evaluation.evaluate(None, tok, [source], n=10, k=2)["arithmetic"]
  assert out == {"n": 10, "skipped": 0, "pass@1_greedy": 1.0, "pass@1_sampled": 0.5,
                 "pass@2": 1.0}
  monkeypatch.setattr(evaluation, "generate", _oracle(tok, records, lambda i, greedy: False))
  out = evaluation.evaluate(None, tok, [source], n=10, k=2)["arithmetic"]
  assert out["pass@1_greedy"] == out["pass@1_sampled"] == out["pass@2"] == 0.0


def test_one_engine_for_greedy_and_sampled_passes(tok):
  """`evaluate` runs greedy and sampled requests through the engine it is given (per-request
  temperature); prompts it has no room for are counted as skipped, not scored."""
  from spec_rl_jax.rollout.engine import RolloutEngine
  from spec_rl_jax.rollout.types import EngineConfig
  source = Source.parse("task:arithmetic?max_digits=2")
  engine = evaluation.engine_for(init_decoder(TINY, seed=0), tok, [source], n=4)
  out = evaluation.evaluate(engine, tok, [source], n=4, k=2)["arithmetic"]
  assert out["n"] == 4 and out["skipped"] == 0
  assert engine.stats["prefills"] >= 2  # the greedy pass, then the sampled one
  greedy = evaluation.generate(engine, [tok.encode("1+1=")], 8, 0.0)
  assert greedy == evaluation.generate(engine, [tok.encode("1+1=")], 8, 0.0)
  # An engine too short for these prompts skips them all.
  small = RolloutEngine(init_decoder(TINY, seed=0), EngineConfig(
      num_slots=2, page_size=4, num_pages=8, max_seq_len=8, max_new_tokens=4))
  out = evaluation.evaluate(small, tok, [source], n=4, k=2)["arithmetic"]
  assert out["skipped"] == 4 and out["n"] == 0


def test_draft_acceptance(tok):
  policy = init_decoder(TINY, seed=0)
  source = Source.parse("task:countdown")
  engine = evaluation.engine_for(policy, tok, [source], n=4)
  same = evaluation.draft_acceptance(engine, policy, policy, tok, source, n=4)
  assert same["acceptance_prob"] == pytest.approx(1.0, abs=1e-5)
  assert same["greedy_agreement"] == 1.0
  other = evaluation.draft_acceptance(engine, init_decoder(TINY, seed=1), policy, tok, source,
                                      n=4)
  assert 0.0 < other["acceptance_prob"] < 0.999


def test_cli_on_a_hf_checkpoint(tok, tmp_path, capsys):
  model_dir, draft_dir = str(tmp_path / "model"), str(tmp_path / "draft")
  hf_io.save_hf_checkpoint(init_decoder(TINY, seed=0), model_dir, tok)
  hf_io.save_hf_checkpoint(init_decoder(TINY, seed=1), draft_dir, tok)
  out = tmp_path / "r.json"
  evaluation.main(["--model", model_dir, "--data", "task:arithmetic?max_digits=2",
                   "--n", "3", "--k", "2", "--draft", draft_dir, "--out", str(out)])
  result = json.loads(out.read_text())
  assert result == json.loads(capsys.readouterr().out)
  acc = result["accuracy"]["arithmetic"]
  assert set(acc) == {"n", "skipped", "pass@1_greedy", "pass@1_sampled", "pass@2"}
  assert acc["n"] == 3 and acc["skipped"] == 0
  assert all(0 <= v <= 1 for k, v in acc.items() if k not in ("n", "skipped"))
  assert not math.isnan(result["draft"]["arithmetic"]["acceptance_prob"])


def test_reference_exactness_against_generation(tok):
  """Greedy responses are their own exact reference, with the engine's logprobs; a
  changed token is caught at its position."""
  from spec_rl_jax.rollout.engine import RolloutEngine
  from spec_rl_jax.rollout.types import EngineConfig, Request
  from spec_rl_jax.sampling import SamplingParams
  model = init_decoder(TINY, seed=0)
  rng = np.random.default_rng(0)
  prompts = [rng.integers(5, 500, int(n)).tolist() for n in (3, 9, 5, 12)]
  engine = RolloutEngine(model, EngineConfig(
      num_slots=2, page_size=16, num_pages=8, max_seq_len=64, max_new_tokens=20,
      sampling=SamplingParams(temperature=0.0)))
  responses = engine.generate([Request(p, i) for i, p in enumerate(prompts)]).responses
  refs = [r.tokens for r in responses]
  out = evaluation.reference_exactness(model, prompts, refs, batch_size=3)
  assert out["greedy_exact"] == 1.0 and out["token_error"] == 0.0
  want = np.mean([math.exp(r.policy_logprobs.sum()) for r in responses])
  assert out["sampled_prob"] == pytest.approx(want, rel=1e-4)
  assert math.isnan(out["first_error_frac"])
  bad = [list(r) for r in refs]
  bad[1][10] = (bad[1][10] + 1) % TINY.vocab_size  # the argmax there is now wrong
  out = evaluation.reference_exactness(model, prompts, bad, batch_size=3)
  assert out["greedy_exact"] == 0.75
  assert out["first_error_frac"] == pytest.approx(10 / len(bad[1]))
  assert out["token_error"] >= 1 / sum(map(len, bad))
  assert out["sampled_prob"] < want


def test_cli_reference_mode(tok, tmp_path, capsys):
  model_dir = str(tmp_path / "model")
  hf_io.save_hf_checkpoint(init_decoder(TINY, seed=0), model_dir, tok)
  evaluation.main(["--model", model_dir, "--data", "task:counting?min_span=2,max_span=4",
                   "--n", "3", "--reference"])
  result = json.loads(capsys.readouterr().out)
  assert "accuracy" not in result
  ref = result["reference"]["counting"]
  assert ref["n"] == 3 and 0 <= ref["greedy_exact"] <= 1 and 0 < ref["token_error"] <= 1
  # Two sources of one task are told apart by their parameters, not overwritten.
  evaluation.main(["--model", model_dir, "--data", "task:counting?min_span=2,max_span=4",
                   "task:counting?min_span=30,max_span=40", "task:counting", "--n", "3",
                   "--reference"])
  both = json.loads(capsys.readouterr().out)["reference"]
  assert set(both) == {"counting?max_span=4,min_span=2", "counting?max_span=40,min_span=30",
                       "counting"}
  assert both["counting?max_span=4,min_span=2"] == ref
  assert both["counting?max_span=40,min_span=30"] != ref
