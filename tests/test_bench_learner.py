"""`bench.learner` end to end on a tiny policy: its JSON carries the headline ratios and
the breakdown, finite and positive."""

import json
import math

import pytest

from spec_rl_jax.bench import learner as bench


@pytest.mark.slow
def test_quick_run_writes_the_summary_ratios_and_breakdown(tmp_path):
  out = tmp_path / "learner.json"
  bench.main(["--quick", "--preset", "tiny-qwen3", "--responses", "8",
              "--micro-batch-size", "4", "--kl-coef", "0.1", "--reps", "1",
              "--out", str(out)])
  result = json.loads(out.read_text())
  assert result["bench"] == "learner" and result["quick"]
  for case in bench.ROLLOUTS:
    ratio = result["summary"][f"update_vs_matmul_flops_{case}"]
    assert math.isfinite(ratio) and ratio > 0
    assert result["summary"][f"compiles_after_warmup_{case}"] >= 0
    rows = {r["metric"]: r["value"] for r in result["rows"] if r["case"] == case}
    assert rows["extra_forwards"] == 1  # β > 0: the reference's forward is counted
    assert rows["computed_positions"] >= rows["real_tokens"] > 0
    for metric in ("update_GFLOPs", "matmul_GFLOPs", "s_per_micro_batch", "host_pack_s"):
      assert math.isfinite(rows[metric]) and rows[metric] > 0, metric
