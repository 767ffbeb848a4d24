"""Online training of a draft head (MTP, Eagle3) in the learner's update: the head's
loss is SFT's (`head_sft`) on the update's own policy forward, the policy's update is
the one without a head, a non-finite head loss is skipped without reaching the policy,
and RL runs draft with the trained head, losslessly, and resume it exactly."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from spec_rl_jax import checkpoint, export, head_sft, sharding, train
from spec_rl_jax.config import DrafterTrainConfig, LearnerConfig, load_config
from spec_rl_jax.models import eagle3, eagle3_io, mtp
from spec_rl_jax.models.config import get_preset
from spec_rl_jax.models.transformer import init_decoder
from spec_rl_jax.rl import losses, rewards
from spec_rl_jax.rl.learner import Learner
from spec_rl_jax.rl.metrics import read_metrics
from spec_rl_jax.rl.rewards import score_batch
from tests.rl_fixtures import random_rollouts, tiny_overrides, write_tiny_models

CFG = get_preset("tiny-qwen3", vocab_size=96)
N, PROMPT, RESPONSE = 8, 5, 12
LEARNER = LearnerConfig(lr=1e-3, warmup_steps=1, micro_batch_size=4)
TRAIN = DrafterTrainConfig(every=1, lr=3e-3, warmup_steps=1)


def _batch() -> dict[str, np.ndarray]:
  return random_rollouts(1, N, PROMPT, RESPONSE, CFG.vocab_size, min_response=2)


def _leaves(tree):
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


# A fresh head of each kind for the policy CFG.
HEADS = {"mtp": lambda: mtp.init_heads(mtp.MTPConfig(2, CFG), seed=3),
         "eagle3": lambda: eagle3.init_head(eagle3.Eagle3Config.for_policy(CFG, (1, 1, 1)),
                                            seed=2)}


def _heads() -> mtp.MTPHeads:
  return HEADS["mtp"]()


def _learner(heads=None, draft_cfg=TRAIN, kind="mtp") -> Learner:
  return Learner(init_decoder(CFG, seed=0), LEARNER, RESPONSE, heads,
                 draft_cfg if heads is not None else None, 1.0,
                 draft_head=kind if heads is not None else None)


@pytest.fixture(scope="module")
def policy_only():
  """The policy's parameters after one update without a drafter."""
  learner = _learner()
  learner.update(_batch())
  return _leaves(learner.state["params"])


@pytest.mark.parametrize("name", HEADS)
def test_online_head_loss_is_sfts_and_leaves_the_policy_update(policy_only, name):
  learner = _learner(HEADS[name](), kind=name)
  head0 = learner.draft_model()
  before = _leaves(learner.state["draft"])
  batch = _batch()
  # SFT's loss of the head on the same batch (one mini-batch: uniform weights are the
  # response mask's mean), from the policy's outputs at the update's parameters.
  kind = head_sft.head_kind(name)
  out, tables = head_sft._policy_pass(learner.graphdef, learner.state["params"], head0,
                                      batch["tokens"], batch["valid"])
  sft_batch = {"tokens": batch["tokens"], "valid": batch["valid"], "loss_mask": batch["mask"]}
  want_loss, _ = head_sft.head_loss(head0, tables, out, sft_batch, kind, kind.Options())
  # The first draft's acceptance against the policy, on the head's vocabulary.
  _, _, q, p = head_sft.head_distill(head0, tables, out, batch["tokens"], batch["valid"],
                                     head_sft.mask_weights(batch["mask"]), kind,
                                     kind.Options())
  alpha = losses.acceptance_prob(q[0], p)
  want_accept = float((alpha * batch["mask"]).sum() / batch["mask"].sum())

  metrics = learner.update(batch, train_draft=True)
  assert metrics["skipped"] == metrics["draft_skipped"] == 0
  assert metrics["draft_loss"] == pytest.approx(float(want_loss), rel=1e-5)
  assert metrics["draft_acceptance"] == pytest.approx(want_accept, rel=1e-5)
  for x, y in zip(_leaves(learner.state["params"]), policy_only, strict=True):
    np.testing.assert_allclose(x, y, rtol=0, atol=1e-7)
  assert max(np.abs(x - y).max() for x, y in zip(_leaves(learner.state["draft"]), before)) > 0
  assert type(learner.draft_model()) is type(head0)
  assert learner.draft_model().cfg == head0.cfg


def test_reward_weighted_head_loss():
  """ReSpec's reward weighting weighs the head's positions as it does a draft model's:
  the head's loss with the weights ``losses.draft_weights("reward", ...)`` (the SFT loss
  function with other weights)."""
  train_cfg = dataclasses.replace(TRAIN, weighting="reward", reward_temperature=0.5)
  learner = _learner(_heads(), train_cfg)
  head0, batch, kind = learner.draft_model(), _batch(), head_sft.head_kind("mtp")
  out, tables = head_sft._policy_pass(learner.graphdef, learner.state["params"], head0,
                                      batch["tokens"], batch["valid"])
  w = losses.draft_weights("reward", batch["mask"], batch["reward"], 0.5)
  want, *_ = head_sft.head_distill(head0, tables, out, batch["tokens"], batch["valid"], w,
                                   kind, kind.Options())
  uniform, *_ = head_sft.head_distill(head0, tables, out, batch["tokens"], batch["valid"],
                                      head_sft.mask_weights(batch["mask"]), kind,
                                      kind.Options())
  assert abs(float(want) - float(uniform)) > 1e-4  # the weighting matters on this batch
  metrics = learner.update(batch, train_draft=True)
  assert metrics["draft_loss"] == pytest.approx(float(want), rel=1e-5)


def test_nan_head_is_skipped_and_never_reaches_the_policy(policy_only):
  heads = _heads()
  scale = heads.layers.head_norm.scale
  scale[...] = jnp.full_like(scale[...], jnp.nan)
  learner = _learner(heads)
  metrics = learner.update(_batch(), train_draft=True)
  assert metrics["draft_skipped"] == 1 and metrics["skipped"] == 0
  for x, y in zip(_leaves(learner.state["params"]), policy_only, strict=True):
    np.testing.assert_allclose(x, y, rtol=0, atol=1e-7)
  assert np.isnan(np.asarray(learner.state["draft"]["layers"]["head_norm"]["scale"])).all()


@pytest.mark.mesh
def test_head_on_the_policys_mesh():
  """With the policy on a (1, 1, 2) mesh, the head's weights and moments are laid out
  on that mesh by the policy's rules (tensor-parallel where a rule says so), and the
  update trains it there."""
  mesh = sharding.make_mesh((1, 1, 2))
  learner = Learner(init_decoder(CFG, seed=0, mesh=mesh), LEARNER, RESPONSE, _heads(), TRAIN,
                    1.0, draft_head="mtp")
  metrics = learner.update(_batch(), train_draft=True)
  assert metrics["draft_skipped"] == 0 and np.isfinite(metrics["draft_loss"])
  draft, opt = (jax.tree.leaves(learner.state[k]) for k in ("draft", "draft_opt"))
  assert {x.sharding.mesh for x in draft + opt} == {mesh}
  assert any("tensor" in str(x.sharding.spec) for x in draft)
  # Adam's moments are laid out like the weights; the step counters are replicated.
  assert {x.sharding.spec for x in opt} == {x.sharding.spec for x in draft} | {P()}


def test_heads_that_cannot_train_online():
  with pytest.raises(ValueError, match="forward KL"):
    _learner(_heads(), dataclasses.replace(TRAIN, loss="tv"))
  other = mtp.init_heads(mtp.MTPConfig(2, dataclasses.replace(CFG, vocab_size=64)), seed=3)
  with pytest.raises(ValueError, match="vocabulary"):
    _learner(other)
  with pytest.raises(ValueError, match="unknown head 'medusa'"):
    _learner(_heads(), kind="medusa")


# --------------------------------------------------------------------------- RL runs


@pytest.fixture(scope="module")
def models(tmp_path_factory):
  return write_tiny_models(str(tmp_path_factory.mktemp("models")))


# Greedy rollouts: whatever the head drafts, the responses are the policy's argmax.
ONLINE = {"drafter.num_draft_tokens": 2, "drafter.train.every": 1, "rollout.temperature": 0.0}
LOAD = {"mtp": mtp.load_mtp, "eagle3": eagle3_io.load_eagle3}


def _run(models, run_dir, monkeypatch, resume=False, **extra):
  """``(trainer, metrics records, the responses' texts per step)`` of a tiny run."""
  texts = []

  def recording(records, responses, *args, **kw):
    texts.append(list(responses))
    return score_batch(records, responses, *args, **kw)

  monkeypatch.setattr(train, "score_batch", recording)
  trainer = train.Trainer(load_config(None, tiny_overrides(models, str(run_dir), **extra)),
                          resume=resume)
  try:
    trainer.run()
  finally:
    trainer.close()
  return trainer, read_metrics(str(run_dir)), texts


@pytest.fixture(scope="module", params=["mtp", pytest.param("eagle3", marks=pytest.mark.slow)])
def head_run(models, tmp_path_factory, request):
  """``(kind, run)``: two greedy steps that train the ``kind`` head online."""
  with pytest.MonkeyPatch.context() as monkeypatch:
    return request.param, _run(models, tmp_path_factory.mktemp(request.param), monkeypatch,
                               **{**ONLINE, "drafter.proposer": request.param})


def test_rl_run_trains_the_head(models, head_run):
  """The head changes, the engine drafts with the learner's new head (lag 1) and the
  update logs the head's loss and acceptance."""
  name, (trainer, records, _) = head_run
  for r in records:
    assert r["train/draft_skipped"] == 0 and r["spec/draft_lag_steps"] == 1
    assert r["train/draft_loss"] > 0 and 0 < r["train/draft_acceptance"] <= 1
    assert r["spec/acceptance_length"] >= 1.0
  start = LOAD[name](models[name])
  head = trainer.proposer.model()
  assert type(head) is type(start)
  assert max(np.abs(x - y).max() for x, y in zip(
      _leaves(nnx.state(head, nnx.Param)), _leaves(nnx.state(start, nnx.Param)),
      strict=True)) > 0
  for x, y in zip(_leaves(nnx.state(head, nnx.Param)), _leaves(trainer.learner.state["draft"]),
                  strict=True):
    np.testing.assert_array_equal(x, y)


@pytest.mark.slow
def test_online_head_keeps_greedy_rollouts_lossless(models, head_run, tmp_path, monkeypatch):
  """Drafting with the head as it trains, the greedy responses are the autoregressive
  run's, step by step."""
  _, _, ar_texts = _run(models, tmp_path / "ar", monkeypatch,
                        **{**ONLINE, "drafter.num_draft_tokens": 0, "drafter.train.every": 0})
  assert head_run[1][2] == ar_texts


@pytest.mark.slow
@pytest.mark.parametrize("name", HEADS)
def test_resume_restores_the_head_and_its_optimizer(models, tmp_path, monkeypatch, name):
  """Async (staleness 1), stopped at the checkpoint after step 2 and resumed, a run
  that trains the head online ends with the uninterrupted run's policy, head and head
  optimizer state, bit for bit (sampled rollouts: the policy moves, and the resumed
  run drafts from the restored head); the run exports the trained head whole."""
  # Rewards that vary within a group on random tiny models: the policy moves.
  monkeypatch.setitem(rewards.REWARDS, "parity", lambda response, answer: len(response) % 2)
  prompts = tmp_path / "prompts.jsonl"
  prompts.write_text("".join(f'{{"prompt": "{a}+{b}=", "answer": "{a + b}"}}\n'
                             for a in range(4) for b in range(3)))
  run = {**ONLINE, "drafter.proposer": name, "rollout.temperature": 1.0, "learner.lr": 1e-2,
         "data.sources": f"[jsonl:{prompts}]", "data.default_reward": "parity",
         "steps": 4, "checkpoint.every": 2, "rl.mode": "async", "rl.max_staleness": 1,
         "learner.loss": "decoupled_ppo"}
  straight, want, _ = _run(models, tmp_path / "straight", monkeypatch, **run)
  _run(models, tmp_path / "stopped", monkeypatch, **{**run, "steps": 2})
  resumed, records, _ = _run(models, tmp_path / "stopped", monkeypatch, resume=True, **run)
  assert [r["step"] for r in records] == [1, 2, 3, 4]
  for a, b in zip(want, records, strict=True):
    assert (a["train/loss"], a["train/draft_loss"]) == (b["train/loss"], b["train/draft_loss"])
  for key in ("params", "draft", "draft_opt"):
    for x, y in zip(_leaves(straight.learner.state[key]), _leaves(resumed.learner.state[key]),
                    strict=True):
      np.testing.assert_array_equal(x, y)
  policy0 = nnx.to_pure_dict(nnx.state(checkpoint.load_model(models["policy"])[0]))
  assert max(np.abs(x - y).max() for x, y in zip(
      _leaves(straight.learner.state["params"]), _leaves(policy0), strict=True)) > 0
  out = tmp_path / "export"
  export.export(str(tmp_path / "stopped"), str(out), log=lambda _: None)
  exported = LOAD[name](str(out / name))
  for x, y in zip(_leaves(nnx.state(exported)), _leaves(nnx.state(resumed.proposer.model())),
                  strict=True):
    np.testing.assert_array_equal(x, y)
