"""The memory plan (spec_rl_jax/plan.py): a tiny model's numbers by hand, the shipped
recipes fit their chips, an over-sized recipe fails naming its numbers, and the trainer
refuses a recipe that does not fit before it loads a weight."""

import json
import os

import pytest

from spec_rl_jax import checkpoint, plan
from spec_rl_jax.config import load_config
from spec_rl_jax.models import hf_io
from spec_rl_jax.models.config import get_preset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
V5P = os.path.join(ROOT, "configs", "qwen3_8b_v5p.yaml")
SMALL = os.path.join(ROOT, "configs", "qwen3_0.6b_gsm8k.yaml")

# tiny-qwen3 (V=128, D=64, F=128, L=2, H=4, Hk=2, Dh=16, tied, fp32) on fsdp=2 x tensor=2.
TINY = ["plan.policy_model=tiny-qwen3", "policy.path=/nonexistent", "policy.mesh=[1,2,2]",
        "drafter.num_draft_tokens=0", "rollout.num_slots=8", "rollout.page_size=16",
        "rollout.num_pages=64", "rollout.max_prompt_len=16", "rollout.max_new_tokens=48",
        "learner.micro_batch_size=8"]


def test_tiny_model_plan_by_hand():
  c = get_preset("tiny-qwen3")
  (p,) = plan.plan(load_config(None, TINY), 1 << 30, "test")
  rows = dict(p.rows)
  V, D, F, L, H, K, Dh = 128, 64, 128, 2, 4, 2, 16
  # Every matrix splits 4 ways (vocab/heads/KV heads/MLP over tensor, embed over fsdp);
  # the norms (per layer: attention, MLP, q, k; and the final one) are replicated.
  matrices = V * D + L * (H * Dh * D + 2 * K * Dh * D + D * H * Dh + 3 * F * D)
  norms = L * (2 * D + 2 * Dh) + D
  params = (matrices // 4 + norms) * 4
  assert rows["policy params"] == params
  assert rows["policy gradients"] == params
  assert rows["policy weights, rollout engine's copy"] == params
  # Adam's two moments, plus two int32 step counters (Adam's and the schedule's).
  assert rows["policy Adam moments"] == 2 * params + 2 * 4
  # K, V pages [L, Hk, P, Ps, Dh] and key bounds [L, Hk, P, Dh], KV heads over tensor.
  P, Ps = 64, 16
  assert rows["policy KV pool"] == 2 * L * (K // 2) * P * (Ps + 1) * Dh * 4
  assert p.total == sum(rows.values()) and p.fits
  # One chip computes the tensor-split widths and its share of the micro-batch's rows.
  local = plan.local_config(c, {"data": 1, "fsdp": 2, "tensor": 2})
  assert (local.num_heads, local.num_kv_heads, local.mlp_dim, local.vocab_size) == (2, 1, 64, 64)
  assert "update activations (4 x 64 tokens, remat off)" in rows


def test_remat_keeps_one_layer_input_per_layer():
  """Under remat a layer's backward keeps only its input ``[rows, T, D]``; the plan's
  activations grow by exactly that per layer."""
  cfg = load_config(None, TINY + ["learner.rematerialize=true"])
  shape = {"data": 1, "fsdp": 2, "tensor": 2}
  c = get_preset("tiny-qwen3")
  (two, rows, T), (four, _, _) = (plan.update_activation_bytes(cfg, c.replace(num_layers=n),
                                                               None, shape) for n in (2, 4))
  assert (rows, T) == (4, 64)
  assert four - two == 2 * rows * T * c.embed_dim * 4


def test_disjoint_rollout_mesh_plans_each_side():
  """Engine on its own (1, 1, 2) mesh: the learner's chips hold the training state and
  the activations, the engine's the weight copy, the KV pool and the slots; together
  the same components as on one shared mesh."""
  (shared,) = plan.plan(load_config(None, TINY), 1 << 30, "test")
  learner, engine = plan.plan(load_config(None, TINY + ["rollout.mesh=[1,1,2]"]), 1 << 30,
                              "test")
  assert (learner.role, engine.role) == ("learner, policy.mesh", "rollout engine, rollout.mesh")
  assert dict(engine.mesh) == {"data": 1, "fsdp": 1, "tensor": 2}
  names = lambda p: {name for name, _ in p.rows}  # noqa: E731
  assert names(learner) | names(engine) == names(shared)
  assert not names(learner) & names(engine)
  assert "policy KV pool" in names(engine) and "policy Adam moments" in names(learner)
  rows, shared_rows = dict(engine.rows), dict(shared.rows)
  # KV heads split over tensor=2 on both meshes; the weights' embed dimension, split
  # over fsdp=2 on the shared mesh, is whole on each engine chip.
  assert rows["policy KV pool"] == shared_rows["policy KV pool"]
  assert rows["policy weights, rollout engine's copy"] != shared_rows[
      "policy weights, rollout engine's copy"]
  assert "of the rollout engine" in engine.table() and "(rollout engine, rollout.mesh)" in (
      plan.Plan(engine.mesh, engine.rows, 1, "chip", engine.role).error())


@pytest.mark.parametrize("recipe, chip", [(V5P, "tpu-v5p"), (SMALL, "h100-80gb")])
def test_shipped_recipes_fit_with_a_margin(recipe, chip):
  cfg = load_config(recipe)
  assert cfg.plan.chip == chip
  (p,) = plan.plan(cfg, plan.CHIPS[chip].usable, plan.CHIPS[chip].name)
  assert p.fits and p.budget - p.total >= 0.1 * p.budget, p.table()
  assert "margin" in p.table()


def test_over_sized_recipe_fails_naming_the_numbers(capsys):
  """The v5p recipe as it was: KV pools over tensor=4 only, 32768 pages, no remat."""
  old = ["policy.mesh=[1,8,4]", "rollout.num_slots=512", "rollout.num_pages=32768",
         "learner.rematerialize=false"]
  assert plan.main(["--config", V5P, *old]) == 1
  captured = capsys.readouterr()
  assert "OVER BY" in captured.out
  err = captured.err
  assert "does not fit TPU v5p" in err and "85.50 GiB usable" in err
  assert "policy KV pool 145.12 GiB" in err and "drafter state (draft_model" in err


def test_preset_must_describe_the_checkpoint(tmp_path):
  with open(tmp_path / "config.json", "w") as f:
    json.dump(hf_io.config_to_hf(get_preset("tiny-llama")), f)
  cfg = load_config(None, [f"policy.path={tmp_path}", "plan.policy_model=tiny-qwen3"])
  with pytest.raises(plan.PlanError, match="plan.policy_model=tiny-qwen3 does not describe"):
    plan.plan(cfg)
  with pytest.raises(plan.PlanError, match="name it with plan.policy_model"):
    plan.plan(load_config(None, ["policy.path=/nonexistent"]))


def test_trainer_refuses_a_recipe_that_does_not_fit_before_loading(tmp_path, monkeypatch):
  from spec_rl_jax import train  # noqa: PLC0415

  model = tmp_path / "model"
  model.mkdir()
  with open(model / "config.json", "w") as f:
    json.dump(hf_io.config_to_hf(get_preset("tiny-qwen3")), f)

  def load_model(path):
    raise AssertionError(f"loaded {path} before the plan refused the recipe")

  monkeypatch.setattr(checkpoint, "load_model", load_model)
  # 2^26 pages of 16 positions at 512 bytes each, and their key bounds: 544 GiB.
  cfg = load_config(None, [f"policy.path={model}", f"run_dir={tmp_path / 'run'}",
                           "drafter.num_draft_tokens=0", "rollout.num_pages=67108864",
                           "plan.chip=tpu-v5e"])
  with pytest.raises(plan.PlanError, match="policy KV pool 544.00 GiB"):
    train.Trainer(cfg)
