"""`bench.rl`'s summary ratios from step records (the trainer's ``time/*`` fields), its
evaluation schedule, its AR vs SD figure, and its sync vs async comparison end to end."""

import json

import matplotlib.image
import numpy as np
import pytest

from spec_rl_jax.bench.rl import (interleave_evaluated, main, plot_runs, recipe_speedups,
                                  seed_mean)
from spec_rl_jax.bench.rl_async import compare, parse_modes
from tests.rl_fixtures import tiny_overrides, write_tiny_models


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
           "update_compile_s": 0.0, "learner_idle_frac": 0.5 + 0.4 * (t == 1)}
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


def test_parse_modes():
  assert parse_modes("sync,async,async:2") == {"sync": ("sync", 0), "async:1": ("async", 1),
                                                "async:2": ("async", 2)}
  assert list(parse_modes("async:0,sync")) == ["async:0", "sync"]
  for bad, message in (("sync,turbo", "bad mode"), ("sync:1,async", "bad mode"),
                       ("sync,async:x", "bad mode"), ("sync,async,async:1", "twice"),
                       ("async", "no sync")):
    with pytest.raises(ValueError, match=message):
      parse_modes(bad)


def mode_step(seed, system, step, step_s, idle_frac, reward, rollout_compile=0.0,
              update_compile=0.0, **extra):
  return {"seed": seed, "system": system, "step": step, "step_s": step_s,
          "learner_idle_frac": idle_frac, "rollout_busy_frac": 1.0 - idle_frac / 2,
          "reward_mean": reward,
          "rollout_compile_s": rollout_compile, "update_compile_s": update_compile, **extra}


def test_compare_derives_every_mode_figure_from_the_step_records():
  # Per seed, sync: 10 s steps, the learner waiting 6 s for rollouts, step 3's rollout
  # compiling 2 s of them; async:1: 5 s steps waiting 1 s, step 3's rollout compiling
  # 2 s (only 1 s of which the learner sat through). Step 1 compiles: left out.
  steps = []
  for seed, sync_r, async_r in ((0, (0.1, 0.2, 0.3), (0.1, 0.2, 0.4)),
                                (1, (0.2, 0.3, 0.5), (0.1, 0.3, 0.6))):
    steps += [mode_step(seed, "sync", 1, 10, 0.8, sync_r[0], 4, 1, staleness_hist=[1.0],
                        staleness_mean=0.0, staleness_max=0),
              mode_step(seed, "sync", 2, 10, 0.6, sync_r[1], staleness_hist=[1.0],
                        staleness_mean=0.0, staleness_max=0),
              mode_step(seed, "sync", 3, 10, 0.6, sync_r[2], 2, staleness_hist=[1.0],
                        staleness_mean=0.0, staleness_max=0)]
    steps += [mode_step(seed, "async:1", t, dt, idle, r, compile_s, staleness_hist=hist,
                        staleness_mean=hist[1], staleness_max=int(hist[1]), iw_mean=iw,
                        iw_max=iw_max, iw_truncated_frac=cut)
              for t, dt, idle, r, compile_s, hist, iw, iw_max, cut in (
                  (1, 9, 0.9, async_r[0], 4, [1.0, 0.0], 1.0, 1.0, 0.0),
                  (2, 5, 0.2, async_r[1], 0, [0.0, 1.0], 0.9, 1.5, 0.1),
                  (3, 5, 0.2, async_r[2], 2, [0.0, 1.0], 1.1, 3.0, 0.2))]
  timelines = [{"seed": seed, "system": "sync", "rollout": [[0, 0, 2], [1, 3, 5]],
                "update": [[0, 2, 3], [1, 5, 6]]} for seed in (0, 1)]
  # async: step 1's rollout [2, 5] overlaps update 0 [2, 4] for 2 s, step 2's [5, 7]
  # update 1 [5, 6] for 1 s: 3 s of 5.
  timelines += [{"seed": seed, "system": "async:1",
                 "rollout": [[0, 0, 2], [1, 2, 5], [2, 5, 7]],
                 "update": [[0, 2, 4], [1, 5, 6], [2, 7, 8]]} for seed in (0, 1)]
  rows, summary = compare(steps, timelines, ["sync", "async:1"])
  # net step: sync 10 and 10 - 2, async 5 and 5 - 1: 2x both
  assert summary["step_speedup_async1_vs_sync"] == pytest.approx(2.0)
  assert summary["step_speedup_async1_vs_sync_incl_compile"] == pytest.approx(2.0)
  # waits less compiles, per seed: sync 6 + 4, async 1 + 0
  assert summary["learner_idle_removed_async1_vs_sync"] == pytest.approx(1 - 1 / 10)
  assert summary["learner_idle_removed_async1_vs_sync_incl_compile"] == pytest.approx(
      1 - 2 / 12)
  assert summary["rollout_overlap_async1"] == pytest.approx(3 / 5)
  std = np.std([0.3, 0.5], ddof=1)  # both modes' finals differ by 0.2 across seeds
  assert summary["final_reward_seed_std"] == pytest.approx(std)
  assert summary["final_reward_diff_async1_minus_sync"] == pytest.approx(0.1)
  assert summary["final_reward_diff_async1_over_seed_std"] == pytest.approx(0.1 / std)
  sync, stale = rows
  assert sync["overlap"] == 0.0 and sync["iw_mean"] is None
  assert sync["learner_idle_frac"] == pytest.approx(0.6)
  assert stale["rollout_busy_frac"] == pytest.approx(0.9)
  assert stale["staleness_hist"] == pytest.approx([1 / 3, 2 / 3])
  assert stale["staleness_mean"] == pytest.approx(2 / 3) and stale["staleness_max"] == 1
  assert (stale["iw_mean"], stale["iw_max"]) == (pytest.approx(1.0), 3.0)
  assert stale["iw_truncated_frac"] == pytest.approx(0.1)
  assert stale["learner_idle_s"] == pytest.approx(0.5)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
  return write_tiny_models(str(tmp_path_factory.mktemp("models")))


@pytest.mark.slow
def test_mode_comparison_end_to_end_reports_ratios_from_its_records(models, tmp_path):
  out = tmp_path / "bench" / "modes.json"
  summary = main(["--mode", "sync,async", "--seeds", "0,1", "--steps", "3", "--out",
                  str(out), *tiny_overrides(models, str(tmp_path / "unused"))])
  result = json.loads(out.read_text())
  assert result["bench"] == "rl_modes" and result["summary"] == summary
  assert {"backend", "cpus", "jax"} <= set(result["machine"])
  steps, timelines = result["steps"], result["timelines"]
  # Each run whole, the mode order reversed on the second seed.
  assert [(t["seed"], t["system"]) for t in timelines] == [
      (0, "sync"), (0, "async:1"), (1, "async:1"), (1, "sync")]
  run = lambda name, seed: sorted((r for r in steps if r["system"] == name
                                   and r["seed"] == seed), key=lambda r: r["step"])
  warm = {name: run(name, 0)[1:] + run(name, 1)[1:] for name in ("sync", "async:1")}
  net = lambda r: r["step_s"] - r["update_compile_s"] - min(
      r["rollout_compile_s"], r["learner_idle_frac"] * r["step_s"])
  assert summary["step_speedup_async1_vs_sync"] == pytest.approx(np.median(
      [net(s) / net(a) for s, a in zip(warm["sync"], warm["async:1"])]))
  assert summary["step_speedup_async1_vs_sync_incl_compile"] == pytest.approx(np.median(
      [s["step_s"] / a["step_s"] for s, a in zip(warm["sync"], warm["async:1"])]))
  idle = {name: sum(max(r["learner_idle_frac"] * r["step_s"] - r["rollout_compile_s"], 0.0)
                    for r in rs) for name, rs in warm.items()}
  assert summary["learner_idle_removed_async1_vs_sync"] == pytest.approx(
      1 - idle["async:1"] / idle["sync"])
  wall = {name: sum(r["learner_idle_frac"] * r["step_s"] for r in rs) for name, rs in warm.items()}
  assert summary["learner_idle_removed_async1_vs_sync_incl_compile"] == pytest.approx(
      1 - wall["async:1"] / wall["sync"])
  finals = {name: [np.mean([r["reward_mean"] for r in run(name, seed)][-1:]) for seed in (0, 1)]
            for name in ("sync", "async:1")}
  std = np.mean([np.std(f, ddof=1) for f in finals.values()])
  diff = np.mean(finals["async:1"]) - np.mean(finals["sync"])
  assert summary["final_reward_seed_std"] == pytest.approx(std)
  assert summary["final_reward_diff_async1_minus_sync"] == pytest.approx(diff)
  if std:
    assert summary["final_reward_diff_async1_over_seed_std"] == pytest.approx(diff / std)
  assert 0.0 <= summary["rollout_overlap_async1"] <= 1.0
  assert summary["async_loss"] == "decoupled_ppo"
  rows = {r["system"]: r for r in result["rows"] if r["case"] == "modes"}
  # Staleness: none in sync; in async every step but the first trains on version t - 1.
  assert rows["sync"]["staleness_hist"] == [1.0] and rows["sync"]["staleness_max"] == 0
  assert rows["async:1"]["staleness_hist"] == pytest.approx([1 / 3, 2 / 3])
  assert {r["loss"] for r in result["rows"] if r["case"] == "runs"} == {"ppo_clip",
                                                                         "decoupled_ppo"}
  for png in ("rl_modes_reward_curves.png", "rl_timeline_sync.png", "rl_timeline_async1.png"):
    assert np.ptp(matplotlib.image.imread(out.parent / png)) > 0
