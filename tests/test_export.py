"""Export: a tiny RL run's directory → HF checkpoints (policy + draft) that
``transformers`` loads with our logits, and → the next run's ``policy.path``."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from spec_rl_jax import checkpoint, export, train
from spec_rl_jax.config import load_config
from spec_rl_jax.models import eagle3_io, mtp
from spec_rl_jax.models.attention import NoCache
from spec_rl_jax.models.tokenizer import Tokenizer
from tests.rl_fixtures import tiny_overrides, write_tiny_models

DRAFTER = {"drafter.proposer": "draft_model", "drafter.num_draft_tokens": 2,
           "drafter.max_draft_tokens": 2}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """A finished 2-step run with a draft model (checkpoints at steps 1 and 2)."""
  root = tmp_path_factory.mktemp("export")
  models = write_tiny_models(str(root / "models"))
  run_dir = str(root / "run")
  train.main(tiny_overrides(models, run_dir, **DRAFTER))
  return models, run_dir


def _ours_logits(model, tokens):
  positions = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)
  out = model(jnp.asarray(tokens, jnp.int32), jnp.asarray(positions, jnp.int32),
              cache=NoCache(valid=jnp.ones(tokens.shape, bool)))
  return np.asarray(out.logits)


def _hf_logits(directory, tokens):
  hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
  with torch.inference_mode():
    return hf.eval()(input_ids=torch.as_tensor(tokens)).logits.numpy()


def test_export_loads_in_transformers_with_our_logits(run, tmp_path, capsys):
  models, run_dir = run
  out = str(tmp_path / "hf")
  written = export.main([run_dir, out])
  assert written.step == 2 and written.draft == os.path.join(out, "draft")
  assert "draft model ->" in capsys.readouterr().out

  tok = Tokenizer.load(os.path.join(run_dir, checkpoint.TOKENIZER_DIR))
  tokens = np.asarray([tok.encode("12+34=46")])
  policy, _ = checkpoint.load_model(run_dir)  # the run's latest policy, our side
  np.testing.assert_allclose(_hf_logits(out, tokens), _ours_logits(policy, tokens),
                             atol=1e-4, rtol=1e-4)
  # The draft is frozen during RL: the export is exactly the draft the run started with.
  draft_ours, _ = checkpoint.load_model(models["draft"])
  np.testing.assert_allclose(_hf_logits(written.draft, tokens),
                             _ours_logits(draft_ours, tokens), atol=1e-4, rtol=1e-4)

  hf_tok = transformers.AutoTokenizer.from_pretrained(out)
  assert hf_tok.encode("12+34=46", add_special_tokens=False) == tok.encode("12+34=46")
  assert Tokenizer.load(out).eos_ids == tok.eos_ids


def test_export_step_choice_and_errors(run, tmp_path):
  _, run_dir = run
  assert export.main([run_dir, str(tmp_path / "one"), "--step", "1"]).step == 1
  with pytest.raises(ValueError, match=r"no checkpoint at step 7; available steps: \[1, 2\]"):
    export.main([run_dir, str(tmp_path / "seven"), "--step", "7"])
  with pytest.raises(FileExistsError, match="not empty"):
    export.main([run_dir, str(tmp_path / "one")])
  with pytest.raises(FileNotFoundError, match="not a training run directory"):
    export.main([str(tmp_path), str(tmp_path / "x")])


def test_finished_run_is_the_next_runs_policy(run, tmp_path):
  """``policy.path=RUN_DIR`` starts from the run's last parameters, and the new run
  saves its tokenizer before its first step (its steps run like any other's)."""
  models, run_dir = run
  next_dir = str(tmp_path / "next")
  cfg = load_config(None, tiny_overrides(models, next_dir,
                                         **{**DRAFTER, "policy.path": run_dir, "steps": 1}))
  trainer = train.Trainer(cfg)
  try:
    assert os.path.exists(os.path.join(next_dir, "tokenizer", "tokenizer.json"))
    previous, _ = checkpoint.load_model(run_dir)
    jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(nnx.state(previous)),
                 trainer.learner.state["params"])
  finally:
    trainer.close()


HEAD_LOADERS = {"eagle3": eagle3_io.load_eagle3, "mtp": mtp.load_mtp}


@pytest.mark.slow
@pytest.mark.parametrize("proposer", ["eagle3", "mtp"])
def test_a_head_run_exports_its_heads(run, tmp_path, proposer):
  models, _ = run
  run_dir = str(tmp_path / "run")
  train.main(tiny_overrides(models, run_dir, **{**DRAFTER, "drafter.proposer": proposer,
                                                "steps": 1}))
  out = export.main([run_dir, str(tmp_path / "out")])
  assert out.draft == os.path.join(str(tmp_path / "out"), proposer)
  policy, _ = checkpoint.load_model(models["policy"])
  exported = HEAD_LOADERS[proposer](out.draft, policy.cfg)
  original = HEAD_LOADERS[proposer](models[proposer], policy.cfg)
  assert exported.cfg == original.cfg
  jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(nnx.state(exported)),
               nnx.to_pure_dict(nnx.state(original)))


@pytest.mark.parametrize("drafter,reason", [
    ({"proposer": "ngram", "num_draft_tokens": 2}, "the ngram proposer has no weights"),
    ({"proposer": "self_sparse", "num_draft_tokens": "auto"},
     "the self_sparse proposer has no weights"),
    ({"proposer": "draft_model", "num_draft_tokens": 0}, "did not draft")])
def test_no_draft_reason(drafter, reason):
  assert reason in export.no_draft_reason({"config": {"drafter": drafter}})
  assert export.no_draft_reason({"sft": {}}) == "not an RL run: no drafter"
