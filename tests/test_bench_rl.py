"""`bench.rl`'s summary ratios from step records (the trainer's ``time/*`` fields), its
evaluation schedule and its AR vs SD figure."""

import matplotlib.image
import numpy as np
import pytest

from spec_rl_jax.bench.rl import interleave_evaluated, plot_runs, recipe_speedups, seed_mean


def record(rollout, update, tokens, rollout_compile=0.0, update_compile=0.0):
  return {"time/rollout_s": rollout, "time/update_s": update,
          "time/step_s": rollout + update + 0.5, "time/rollout_compile_s": rollout_compile,
          "time/update_compile_s": update_compile, "rollout/response_len": tokens}


def test_recipe_speedups_take_compile_seconds_out_and_keep_the_wall_ratios():
  # AR: 20 s rollout + 10 s update; SD: 10 s rollout + 10 s update, of which the second
  # pair compiles 6 s in SD's rollout and 3 s in AR's update.
  pairs = [(record(20, 10, 1000), record(10, 10, 1000)),
           (record(20, 13, 1000, update_compile=3), record(16, 10, 1000, rollout_compile=6)),
           (record(20, 10, 1000), record(10, 10, 500))]  # SD drew half the tokens
  out = recipe_speedups(pairs)
  assert out["step_speedup_sd_vs_ar_recipe"] == pytest.approx(30.5 / 20.5)
  assert out["rollout_speedup_sd_vs_ar_recipe"] == pytest.approx(2.0)
  # per token: 30.5/20.5 twice and (30.5/1000)/(20.5/500) once
  assert out["step_speedup_per_token_sd_vs_ar_recipe"] == pytest.approx(30.5 / 20.5)
  assert out["step_speedup_sd_vs_ar_recipe_incl_compile"] == pytest.approx(30.5 / 20.5)
  walls = sorted([20 / 10, 20 / 16, 20 / 10])
  assert out["rollout_speedup_sd_vs_ar_recipe_incl_compile"] == pytest.approx(walls[1])
  assert out["ar_rollout_share_recipe"] == pytest.approx(20 / 30.5)
  # With the compiles left in, the compiling pair is the slow one: 33.5 / 26.5.
  slow = recipe_speedups(pairs[1:2])
  assert slow["step_speedup_sd_vs_ar_recipe_incl_compile"] == pytest.approx(33.5 / 26.5)
  assert slow["step_speedup_sd_vs_ar_recipe"] == pytest.approx(30.5 / 20.5)


class CountingTrainer:
  """A trainer's step and evaluation seams: each step logs its number, each evaluation
  the step it saw."""

  def __init__(self):
    self.step = 0

  def train_step(self, bar):
    self.step += 1
    return {"n": self.step}

  def evaluate(self):
    return {"eval/t/pass@1_sampled": self.step / 10}


@pytest.mark.parametrize("every, evaluated", [(2, [0, 2, 4, 5]), (0, [0, 5]), (5, [0, 5])])
def test_interleave_evaluated_evaluates_before_every_segment_and_after_the_last(
    every, evaluated):
  trainers = {"AR": CountingTrainer(), "SD": CountingTrainer()}
  records, evals = interleave_evaluated(trainers, 5, every)
  for name in trainers:
    assert [r["n"] for r in records[name]] == [1, 2, 3, 4, 5]
    assert [e["step"] for e in evals[name]] == evaluated
    assert [e["eval/t/pass@1_sampled"] for e in evals[name]] == [t / 10 for t in evaluated]


def test_seed_mean_averages_each_evaluation_over_seeds():
  seeds = [{"t pass@1_sampled": ([0, 4], [0.1, 0.5])},
           {"t pass@1_sampled": ([0, 4], [0.3, float("nan")])}]
  steps, values = seed_mean(seeds)["t pass@1_sampled"]
  assert steps == [0, 4] and values == pytest.approx([0.2, 0.5])  # a NaN is left out


def bench_steps(seeds):
  """`bench.rl`'s JSON ``steps`` of 6-step AR and SD runs (the first step compiles)."""
  return [{"seed": seed, "system": system, "step": t, "reward_mean": t / 6 + 0.05 * seed,
           "step_s": dt + 4.0 * (t == 1), "rollout_compile_s": 4.0 * (t == 1),
           "update_compile_s": 0.0}
          for seed in seeds for system, dt in (("AR", 2.0), ("SD", 1.5))
          for t in range(1, 7)]


def test_plot_runs_draws_reward_and_held_out_accuracy_of_ar_and_sd(tmp_path):
  held_out = [{"seed": seed, "system": system, "step": t, "eval/t/pass@1_sampled": t / 10,
               "eval/t/pass@1_greedy": t / 8}
              for seed in (0, 1) for system in ("AR", "SD") for t in (0, 3, 6)]
  both = plot_runs(str(tmp_path / "both.png"), bench_steps((0, 1)), held_out)
  reward_only = plot_runs(str(tmp_path / "one.png"), bench_steps((0,)), [])
  # Two rows (reward, held-out accuracy) with evaluations, one without.
  assert matplotlib.image.imread(both).shape[0] > matplotlib.image.imread(reward_only).shape[0]
  assert np.ptp(matplotlib.image.imread(both)) > 0  # not a blank canvas
