"""`bench.drift`'s summary from step records: staleness ratios, speedups, update cost."""

import pytest

from spec_rl_jax.bench.drift import ARMS, WINDOW, summarise

STEPS = 12


def run(tau, tokens_per_s, update_s, reward, draft=False):
  """Records of one run: ``tau(step)`` acceptance length, constant rates."""
  out = []
  for t in range(STEPS):
    r = {"spec/acceptance_length": tau(t), "rollout/tokens_per_s": tokens_per_s,
         "time/update_s": update_s + (5.0 if t == 0 else 0.0),
         "time/update_compile_s": 5.0 if t == 0 else 0.0, "rollout/reward_mean": reward(t)}
    if draft:
      r["train/draft_acceptance"] = 0.8
    out.append(r)
  return out


def test_summary_ratios_from_records():
  # Two seeds. frozen: τ falls linearly 4 -> 2.9; online: τ flat at 4. AR 100 tok/s,
  # frozen 150, online 140; online updates take 1.2x the frozen ones.
  falling = lambda t: 4.0 - 0.1 * t  # noqa: E731
  flat = lambda t: 4.0  # noqa: E731
  reward = lambda t: 0.1 * t  # noqa: E731
  records = {
      "AR": [run(lambda t: 1.0, 100, 1.0, reward) for _ in range(2)],
      "frozen": [run(falling, 150, 1.0, reward) for _ in range(2)],
      "online-uniform": [run(flat, 140, 1.2, reward, True) for _ in range(2)],
      "online-reward": [run(flat, 140, 1.2, lambda t: 0.1 * t + 0.05, True)
                        for _ in range(2)],
  }
  assert list(records) == list(ARMS)
  summary, rows = summarise(records)
  start = sum(falling(t) for t in range(WINDOW)) / WINDOW  # 3.8
  end = sum(falling(t) for t in range(STEPS - WINDOW, STEPS)) / WINDOW  # 3.1
  assert summary["frozen_tau_end_over_start"] == pytest.approx(end / start)
  assert summary["online_uniform_tau_end_over_start"] == pytest.approx(1.0)
  assert summary["frozen_rollout_speedup_vs_ar_end"] == pytest.approx(1.5)
  assert summary["online_reward_rollout_speedup_vs_ar_end"] == pytest.approx(1.4)
  # Compile seconds are taken out of the first step's update before the ratio.
  assert summary["online_uniform_update_time_vs_frozen"] == pytest.approx(1.2)
  assert "frozen_update_time_vs_frozen" not in summary
  # Final reward: the last third (4 steps) of each run; online-reward is 0.05 above AR.
  assert summary["online_reward_final_reward_minus_ar"] == pytest.approx(0.05)
  assert summary["frozen_final_reward_minus_ar"] == pytest.approx(0.0)
  assert summary["ar_final_reward_seed_std"] == 0.0
  by_arm = {r["arm"]: r for r in rows}
  assert by_arm["online-uniform"]["draft_acceptance_end"] == pytest.approx(0.8)
  assert by_arm["AR"]["final_reward"] == pytest.approx(sum(0.1 * t for t in range(8, 12)) / 4)
