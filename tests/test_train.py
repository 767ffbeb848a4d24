"""The full RL loop on tiny models: each proposer, real verifiers, checkpoints, logs."""

import json
import os

import jax
import numpy as np
import pytest

from spec_rl_jax import train
from spec_rl_jax.config import load_config
from spec_rl_jax.rl.metrics import read_metrics
from tests.rl_fixtures import tiny_overrides, write_tiny_models


@pytest.fixture(scope="module")
def models(tmp_path_factory):
  return write_tiny_models(str(tmp_path_factory.mktemp("models")))


@pytest.mark.parametrize("proposer,K", [("draft_model", 3), ("ngram", "auto"),
                                        pytest.param("self_sparse", 2, marks=pytest.mark.slow),
                                        pytest.param("eagle3", 2, marks=pytest.mark.slow),
                                        pytest.param("mtp", 2, marks=pytest.mark.slow),
                                        ("draft_model", 0)])
def test_few_steps_each_proposer(models, tmp_path, proposer, K):
  run_dir = str(tmp_path / "run")
  K_max = 2 if K == "auto" else K
  overrides = tiny_overrides(models, run_dir, **{"drafter.proposer": proposer,
                                                 "drafter.num_draft_tokens": K,
                                                 "drafter.max_draft_tokens": max(K_max, 2),
                                                 "data.format_weight": 0.5})
  summary = train.main(overrides)
  assert summary["steps"] == 2
  records = read_metrics(run_dir)
  assert [r["step"] for r in records] == [1, 2]
  for r in records:
    # r = correct + w * well_formed (w = 0.5); unreadable answers are counted apart.
    assert r["rollout/reward_mean"] == pytest.approx(
        r["rollout/accuracy"] + 0.5 * r["rollout/well_formed_frac"])
    assert 0.0 <= r["rollout/unreadable_frac"] <= 1.0
    assert r["rollout/response_len"] >= 1
    assert r["train/skipped"] == 0
    assert np.isfinite(r["train/loss"])
    # The learner recomputes the rollout's logprobs to float tolerance
    # (step 1: same params; later steps too, since the engine got the new weights).
    assert r["train/logprob_gap"] < 1e-3
    fractions = [r[f"spec/k_frac/{k}"] for k in range(K_max + 1)]
    assert sum(fractions) == pytest.approx(1.0)
    if K and fractions[0] < 1:  # some speculative rounds
      assert 1.0 <= r["spec/acceptance_length"] <= K_max + 1
      assert len(r["spec/acceptance_at"]) == K_max
    else:
      assert r["spec/acceptance_length"] == 1.0 and r["spec/acceptance_at"] == []
    if K == "auto":  # the controller's prediction next to what happened
      assert r["spec/realised_tokens_per_slot_round"] >= 1.0
      assert r["spec/predicted_tokens_per_slot_round"] >= 1.0
    elif K:
      assert fractions[K] == 1.0
  # Step 1 compiles the decode and gradient programs; their seconds are logged apart.
  for phase in ("rollout", "update"):
    assert 0 < records[0][f"time/{phase}_compile_s"] <= records[0][f"time/{phase}_s"]
  assert all(0 < r["time/rollout_decode_s"] < r["time/rollout_s"] for r in records)
  lag = [r["spec/draft_lag_steps"] for r in records]
  assert lag == ([1, 2] if proposer in ("draft_model", "eagle3", "mtp") and K_max else [0, 0])
  assert load_config(os.path.join(run_dir, "config.yaml")) == load_config(None, overrides)
  assert sorted(os.listdir(os.path.join(run_dir, "ckpt")))[-1] == "2"
  assert {os.path.basename(p) for p in summary["plots"]} == {"reward.png",
                                                             "acceptance_length.png"}
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    assert all(json.loads(line)["step"] in (1, 2) for line in f)


@pytest.mark.mesh
def test_draft_model_on_a_mesh_through_the_trainer(models, tmp_path, monkeypatch):
  """A draft model with the policy on a (1, 1, 2) mesh: its weights and KV pools are
  placed on the policy's mesh (this crashed at the first prefill before), and it is
  distilled from the policy there, its weights and moments laid out by the same rules.
  Evaluation before and after training runs on the trainer's own (speculative) engine:
  no other engine is built."""
  built, trainers = [], []
  for cls, seen in ((train.RolloutEngine, built), (train.Trainer, trainers)):
    monkeypatch.setattr(cls, "__init__", lambda self, *a, _init=cls.__init__, _seen=seen,
                        **kw: (_seen.append(self), _init(self, *a, **kw))[-1])
  run_dir = str(tmp_path / "run")
  overrides = tiny_overrides(models, run_dir, **{"drafter.proposer": "draft_model",
                                                 "drafter.num_draft_tokens": 2,
                                                 "drafter.train.every": 1,
                                                 "policy.mesh": "[1,1,2]", "steps": 1,
                                                 "data.sources": "[task:arithmetic]",
                                                 "data.eval_n": 3, "data.eval_k": 2})
  summary = train.main(overrides)
  assert summary["steps"] == 1 and len(built) == 1
  for phase in ("eval_before", "eval_after"):
    ev = summary[phase]
    assert ev["eval/arithmetic/skipped"] == 0
    assert 0 <= ev["eval/arithmetic/pass@1_greedy"] <= 1
  before, record = read_metrics(run_dir)  # eval_before; step 1's metrics and eval_after
  assert before["step"] == 0 and record["step"] == 1
  assert record["eval/arithmetic/pass@1_greedy"] == summary["eval_after"][
      "eval/arithmetic/pass@1_greedy"]
  assert record["train/logprob_gap"] < 1e-3 and record["spec/acceptance_length"] >= 1.0
  assert record["train/draft_skipped"] == 0 and record["spec/draft_lag_steps"] == 1
  assert 0 < record["train/draft_acceptance"] <= 1 and record["train/draft_loss"] > 0
  state = trainers[0].learner.state
  for key, ref in (("draft", "params"), ("draft_opt", "opt")):
    kinds = {str(x.sharding.spec) for x in jax.tree.leaves(state[key])}
    assert kinds & {str(x.sharding.spec) for x in jax.tree.leaves(state[ref])} == kinds
    assert {x.sharding.mesh for x in jax.tree.leaves(state[key])} == {
        state["params"]["embed"].sharding.mesh}
  assert any("tensor" in str(x.sharding.spec) for x in jax.tree.leaves(state["draft"]))
