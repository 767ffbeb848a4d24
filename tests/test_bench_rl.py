"""`bench.rl`'s summary ratios from step records (the trainer's ``time/*`` fields)."""

import pytest

from spec_rl_jax.bench.rl import recipe_speedups


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
