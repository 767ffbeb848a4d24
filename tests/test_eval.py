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
  """A `rollout` that answers each prompt with its reference iff ``correct(i, sample)``."""
  by_prompt = {tuple(tok.encode(r["prompt"] + "\n")): r for r in records}
  counter = itertools.count()

  def rollout(model, prompts, max_new_tokens, eos_ids, params, seed):
    out = []
    for p in prompts:
      r, i = by_prompt[tuple(p)], next(counter)
      text = r["answer"] if correct(i, params.greedy) else "#### -1"
      out.append(tok.encode(text) + [eos_ids[0]])
    return out

  return rollout


def test_scores_follow_the_responses(tok, monkeypatch):
  source = Source.parse("task:arithmetic?max_digits=3")
  records = source.held_out(10, 0)
  # Greedy always right; sampled right on every other call (k=2: one of two per prompt).
  monkeypatch.setattr(evaluation, "rollout",
                      _oracle(tok, records, lambda i, greedy: greedy or i % 2 == 0))
  out = evaluation.evaluate(None, tok, [source], n=10, k=2)["arithmetic"]
  assert out == {"n": 10, "pass@1_greedy": 1.0, "pass@1_sampled": 0.5, "pass@2": 1.0}
  monkeypatch.setattr(evaluation, "rollout", _oracle(tok, records, lambda i, greedy: False))
  out = evaluation.evaluate(None, tok, [source], n=10, k=2)["arithmetic"]
  assert out["pass@1_greedy"] == out["pass@1_sampled"] == out["pass@2"] == 0.0


def test_draft_acceptance(tok):
  policy = init_decoder(TINY, seed=0)
  source = Source.parse("task:countdown")
  same = evaluation.draft_acceptance(policy, policy, tok, source, n=4)
  assert same["acceptance_prob"] == pytest.approx(1.0, abs=1e-5)
  assert same["greedy_agreement"] == 1.0
  other = evaluation.draft_acceptance(init_decoder(TINY, seed=1), policy, tok, source, n=4)
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
  assert set(acc) == {"n", "pass@1_greedy", "pass@1_sampled", "pass@2"} and acc["n"] == 3
  assert all(0 <= v <= 1 for k, v in acc.items() if k != "n")
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
