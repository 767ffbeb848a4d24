"""The run's plots: the trailing moving average, the held-out accuracy series, and the
PNGs `plot_curves` writes from a metrics history."""

import json
import math
import os

import matplotlib.image
import numpy as np
import pytest

from spec_rl_jax.rl.metrics import (held_out_accuracy, moving_average, plot_curves,
                                    trend_window)


def test_moving_average_trails_over_steps_and_leaves_nans_out():
  # Step 4 is missing, step 3's value is NaN; window 3 covers steps (s - 3, s].
  steps = [1, 2, 3, 5, 6, 20]
  values = [1.0, 3.0, math.nan, 5.0, 7.0, math.nan]
  expected = [1.0,  # only step 1 so far
              2.0,  # steps 1, 2
              2.0,  # steps 1, 2 (3 is NaN)
              5.0,  # steps 3 (NaN), 5: step 2 is out of the window
              6.0,  # steps 5, 6
              math.nan]  # step 20 alone, NaN: nothing to average
  np.testing.assert_allclose(moving_average(steps, values, 3), expected)
  np.testing.assert_allclose(moving_average(steps, values, 1), values)


def test_trend_window_is_a_tenth_of_the_run_at_least_three():
  assert [trend_window(n) for n in (1, 30, 39, 200)] == [3, 3, 3, 20]


def test_held_out_accuracy_keeps_the_pass_at_1_values_per_task():
  records = [{"step": 0, "eval/count/pass@1_sampled": 0.1, "eval/count/pass@1_greedy": 0.2,
              "eval/count/pass@4": 0.5, "eval/count/skipped": 0.0},
             {"step": 1, "rollout/reward_mean": 0.3},
             {"step": 2, "eval/count/pass@1_sampled": 0.4, "eval/add/pass@1_sampled": 0.6}]
  assert held_out_accuracy(records) == {"count pass@1_sampled": ([0, 2], [0.1, 0.4]),
                                        "count pass@1_greedy": ([0], [0.2]),
                                        "add pass@1_sampled": ([2], [0.6])}


def write_history(run_dir, evaluate: bool) -> None:
  """Twelve steps of reward and acceptance length, evaluations at steps 0, 6 and 12."""
  rng = np.random.default_rng(0)
  with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
    for t in range(13):
      record = {"step": t}
      if t:
        record.update({"rollout/reward_mean": t / 12 + rng.normal(0, 0.1),
                       "spec/acceptance_length": 2.0 + rng.normal(0, 0.2)})
      if evaluate and t % 6 == 0:
        record.update({"eval/count/pass@1_sampled": t / 20, "eval/count/pass@1_greedy": t / 15})
      if len(record) > 1:
        f.write(json.dumps(record) + "\n")


@pytest.mark.parametrize("evaluate", [True, False])
def test_plot_curves_writes_the_reward_plot_with_its_held_out_panel(tmp_path, evaluate):
  write_history(tmp_path, evaluate)
  paths = plot_curves(str(tmp_path))
  assert [os.path.basename(p) for p in paths] == ["reward.png", "acceptance_length.png"]
  heights = [matplotlib.image.imread(p).shape[0] for p in paths]
  # The held-out panel below the reward makes reward.png taller than the one-panel plot.
  assert (heights[0] > heights[1]) == evaluate
