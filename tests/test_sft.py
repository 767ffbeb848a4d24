"""SFT on a tiny config: the loss falls, checkpoints resume exactly, distillation works."""

import dataclasses
import functools
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from spec_rl_jax import checkpoint, sft
from spec_rl_jax.data import Source, sft_batches
from spec_rl_jax.models import hf_io
from spec_rl_jax.models.config import get_preset
from spec_rl_jax.models.transformer import init_decoder
from spec_rl_jax.tasks.bpe import default_tokenizer

TINY = sft.SFTConfig(
    model="tiny-qwen3", model_overrides=(("vocab_size", 512),),
    data=("task:arithmetic?max_digits=2",), steps=20, batch_size=8, max_len=32, lr=3e-3,
    warmup_steps=2, log_every=5, ckpt_every=10)


@pytest.fixture(scope="module")
def tok():
  return default_tokenizer()


def _eval_batch(tok, cfg):
  return next(iter(sft_batches([Source.parse(s) for s in cfg.data], tok, 32, cfg.max_len,
                               seed=99)))


@functools.partial(jax.jit, static_argnames=("graphdef", "teacher_graphdef", "alpha"))
def _jit_loss(graphdef, params, batch, teacher_graphdef, teacher_params, alpha):
  logits = (None if teacher_graphdef is None else
            sft._logits(teacher_graphdef, teacher_params, batch))
  n = jnp.maximum(batch["loss_mask"].sum(), 1.0)
  return sft.sft_loss(graphdef, params, batch, logits, alpha, n)[0]


def _loss(model, batch, teacher=None, alpha=0.0):
  """The SFT loss of ``model`` on ``batch`` (α-weighted soft CE against ``teacher``)."""
  graphdef, state = nnx.split(model)
  t_graphdef, t_state = nnx.split(teacher) if teacher is not None else (None, None)
  t_params = None if teacher is None else nnx.to_pure_dict(t_state)
  return float(_jit_loss(graphdef, nnx.to_pure_dict(state), batch, t_graphdef, t_params,
                         alpha))


def test_chunked_step_equals_the_whole_batch_step(tok):
  """Rows in scanned chunks: the same update and metrics as the batch at once."""
  model = init_decoder(get_preset("tiny-qwen3", vocab_size=512), 0)
  graphdef, state = nnx.split(model)
  tx = sft.make_optimizer(TINY)
  params = nnx.to_pure_dict(state)
  start = {"params": params, "opt": tx.init(params), "step": jnp.int32(0)}
  batch = next(iter(sft_batches([Source.parse(s) for s in TINY.data], tok, 8, 32)))
  outs = [jax.jit(functools.partial(sft.train_step, graphdef, tx=tx, rows=rows))(start, batch)
          for rows in (8, 2)]
  (whole, m_whole), (chunked, m_chunked) = outs
  for k in m_whole:
    np.testing.assert_allclose(m_chunked[k], m_whole[k], rtol=1e-5, err_msg=k)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7),
               chunked["params"], whole["params"])
  assert float(m_whole["grad_norm"]) > 0


@pytest.fixture(scope="module")
def trained(tok, tmp_path_factory):
  run = str(tmp_path_factory.mktemp("run"))
  model, metrics, info = sft.train(TINY, run, tok, progress=False)
  return run, model, metrics, info


def test_short_run_lowers_the_loss(tok, trained):
  _, model, metrics, info = trained
  batch = _eval_batch(tok, TINY)
  before = _loss(init_decoder(get_preset("tiny-qwen3", vocab_size=512), TINY.seed), batch)
  after = _loss(model, batch)
  assert after < 0.6 * before
  assert info["steps"] == 20 and info["resumed_from"] == 0
  assert np.isfinite(metrics["grad_norm"]) and metrics["loss"] < before
  assert os.listdir(os.path.join(trained[0], "tb"))  # TensorBoard scalars written


def test_resume_from_checkpoint_gives_the_same_future(tok, trained, tmp_path):
  run, model, _, _ = trained
  # A second run killed after its step-10 checkpoint: drop the later one, rerun.
  killed = str(tmp_path / "killed")
  shutil.copytree(run, killed)
  shutil.rmtree(os.path.join(killed, checkpoint.CKPT_DIR, "20"))
  resumed, _, info = sft.train(TINY, killed, tok, progress=False)
  assert info["resumed_from"] == 10
  for a, b in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(resumed))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_resume_refuses_a_different_config(tok, trained):
  with pytest.raises(ValueError, match="different config"):
    sft.train(dataclasses.replace(TINY, lr=1e-3), trained[0], tok, progress=False)


def test_load_model_reads_runs_and_hf_dirs(tok, trained, tmp_path):
  run, model, _, _ = trained
  hf_dir = str(tmp_path / "hf")
  hf_io.save_hf_checkpoint(model, hf_dir, tok)
  batch = _eval_batch(tok, TINY)
  for path in (run, hf_dir):
    loaded, loaded_tok = checkpoint.load_model(path)
    assert loaded_tok.backend.to_str() == tok.backend.to_str()
    np.testing.assert_allclose(_loss(loaded, batch), _loss(model, batch), rtol=1e-6)
  with pytest.raises(FileNotFoundError, match="neither"):
    checkpoint.load_model(str(tmp_path))


def test_distillation_moves_the_student_towards_the_teacher(tok, trained, tmp_path,
                                                            monkeypatch):
  _, teacher, _, _ = trained
  monkeypatch.setenv("SPEC_RL_JAX_CACHE", str(tmp_path))
  hf_io.save_hf_checkpoint(teacher, str(tmp_path / "teacher"), tok)
  cfg = dataclasses.replace(
      TINY, model_overrides=(("vocab_size", 512), ("embed_dim", 32), ("num_layers", 1)),
      teacher="teacher", distill_weight=1.0, steps=10, seed=1)
  student, metrics, _ = sft.train(cfg, str(tmp_path / "student"), tok, progress=False)
  batch = _eval_batch(tok, TINY)
  initial = init_decoder(get_preset("tiny-qwen3", vocab_size=512, embed_dim=32,
                                    num_layers=1), seed=1)
  assert "kd" in metrics and metrics["loss"] == pytest.approx(metrics["kd"])
  # KL(teacher || student) = soft CE - the teacher's entropy.
  entropy = _loss(teacher, batch, teacher, 1.0)
  kl_before = _loss(initial, batch, teacher, 1.0) - entropy
  kl_after = _loss(student, batch, teacher, 1.0) - entropy
  assert 0 < kl_after < 0.75 * kl_before


def test_init_starts_from_the_checkpoint_weights(tok, trained, tmp_path, monkeypatch):
  _, first, _, _ = trained
  monkeypatch.setenv("SPEC_RL_JAX_CACHE", str(tmp_path))
  hf_io.save_hf_checkpoint(first, str(tmp_path / "stage1"), tok)
  # Zero steps: the run's model is the init checkpoint itself.
  cfg = dataclasses.replace(TINY, init="stage1", steps=0, seed=7)
  model, _, _ = sft.train(cfg, str(tmp_path / "stage2"), tok, progress=False)
  for a, b in zip(jax.tree.leaves(nnx.state(first)), jax.tree.leaves(nnx.state(model))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  batch = _eval_batch(tok, TINY)
  cont, _, _ = sft.train(dataclasses.replace(cfg, steps=5), str(tmp_path / "cont"), tok,
                         progress=False)
  fresh, _, _ = sft.train(dataclasses.replace(TINY, steps=5), str(tmp_path / "fresh"), tok,
                          progress=False)
  assert _loss(cont, batch) < _loss(fresh, batch)  # 5 steps on top of 20 beat 5 alone
  other = dataclasses.replace(cfg, model_overrides=(("vocab_size", 512), ("embed_dim", 32)))
  with pytest.raises(ValueError, match="init checkpoint stage1 is a"):
    sft.train(other, str(tmp_path / "other"), tok, progress=False)


def test_stages_missing_from_the_cache_train_first(tmp_path, monkeypatch):
  monkeypatch.setitem(sft.TARGETS, "a", TINY)
  monkeypatch.setitem(sft.TARGETS, "b", dataclasses.replace(TINY, init="a"))
  monkeypatch.setitem(sft.TARGETS, "c", dataclasses.replace(TINY, init="b"))
  root = str(tmp_path)
  assert sft._with_stages(["c", "b"], root) == ["a", "b", "c"]
  os.makedirs(tmp_path / "a")
  (tmp_path / "a" / "config.json").write_text("{}")
  assert sft._with_stages(["c"], root) == ["b", "c"]
  assert sft._with_stages(["a"], root) == ["a"]
