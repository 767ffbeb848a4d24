"""The performance simulator (spec_rl_jax/sim): conservation, monotonicity, calibration
regressions and bad input."""

import dataclasses

import numpy as np
import pytest

from spec_rl_jax.sim import acceptance as acc
from spec_rl_jax.sim import calibrate
from spec_rl_jax.sim.cli import Scenario, main, project
from spec_rl_jax.sim.hardware import get_pod
from spec_rl_jax.sim.models import get_drafter, get_model
from spec_rl_jax.sim.pipeline import Workload, make_plan, simulate_steps

SMALL = Workload(prompts=8, group=8, prompt_len=64, mean_len=512, max_len=2048, steps=4)


def scenario(**kw) -> Scenario:
  base = dict(model="qwen3-8b", hardware="h100-x8", drafter="eagle3", draft_model=None,
              k=3, max_draft_tokens=3, acceptance=tuple(acc.geometric(0.7, 3)),
              workload=SMALL, tp=2, slots=None, staleness=1, rollout_chips=4)
  return Scenario(**{**base, **kw})


def test_model_table_matches_published_sizes():
  assert get_model("qwen3-8b").total_params == pytest.approx(8.19e9, rel=0.01)
  moe = get_model("qwen3-235b-a22b")
  assert moe.total_params == pytest.approx(235e9, rel=0.01)
  assert moe.active_params == pytest.approx(22e9, rel=0.05)
  assert get_model("qwen3-30b-a3b").total_params == pytest.approx(30.5e9, rel=0.01)
  assert get_model("default-policy").total_params == pytest.approx(7.54e6, rel=0.01)


def test_conservation_sync_ar_step_is_rollout_plus_update_plus_transfer():
  res = project(scenario(), ("sync",))
  r = res["AR"]["sync"][1]
  assert r.draft == 0 and r.rollout_idle == 0 and r.learner_idle == 0
  assert r.step == pytest.approx(r.rollout + r.reward + r.learner + r.transfer, rel=1e-9)
  assert r.rollout == pytest.approx(r.prefill + r.verify + r.draft, rel=1e-9)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_more_acceptance_is_never_slower(mode):
  steps = [project(scenario(acceptance=tuple(acc.geometric(x, 3))), (mode,),
                   with_ar=False)["SD"][mode][1].step for x in (0.2, 0.5, 0.8, 1.0)]
  assert all(b <= a * (1 + 1e-9) for a, b in zip(steps, steps[1:])), steps


def test_more_staleness_is_never_slower():
  pod, model = get_pod("h100-x8"), get_model("qwen3-8b")
  d = get_drafter("eagle3", model)
  w = dataclasses.replace(SMALL, steps=6, len_sigma=1.2)
  plan = make_plan(pod, model, d, w, 2, 4, None)
  steps = [simulate_steps(pod, model, d, acc.geometric(0.7, 3), 3, w, plan, s).step_times
           for s in (0, 1, 2, 3)]
  # the same draws: every step of a larger bound ends no later
  ends = [np.cumsum(t) for t in steps]
  assert all(np.all(b <= a + 1e-9) for a, b in zip(ends, ends[1:]))


def test_auto_k_maximises_tokens_per_cost():
  a = acc.geometric(0.8, 4)
  assert acc.choose_k(a, np.ones(5)) == 4  # free drafts: the longest
  assert acc.choose_k(a, 1 + 10 * np.arange(5)) == 0  # drafts dearer than they return
  assert acc.expected_tokens(a)[2] == pytest.approx(1 + 0.8 + 0.64)


def test_calibration_own_runs_within_20_percent():
  """Calibration (a) on the interleaved AR/SD recording (tests/data/sim_cpu_run.json,
  `sim.record`), fed the machine figures probed alongside its steps: rollout within 20%
  for AR and SD. The step is a recorded miss (docs/benchmarks.md): the learner's MFU was
  measured on a quiet machine and the run's update, on a machine at load 6-8, ran
  1.3-1.5x its prediction (AR and SD alike: same work); pinned here as a regression."""
  own = calibrate.own_runs()
  for system in ("AR", "SD"):
    assert abs(own[system]["ratio"]["rollout"] - 1) <= 0.20, own[system]
  assert own["AR"]["ratio"]["step"] == pytest.approx(0.80, abs=0.03)
  assert own["SD"]["ratio"]["step"] == pytest.approx(0.69, abs=0.03)


def test_per_forward_latency_is_tau_plus_lambda_per_layer():
  """On this machine a forward costs its roofline plus ``τ + λ·L`` (λ measured by
  sim.overhead); accelerators keep their launch latency τ and no per-layer term."""
  from spec_rl_jax.sim.cost import forward_cost
  from spec_rl_jax.sim.hardware import this_machine
  from spec_rl_jax.sim.overhead import fit
  model = get_model("default-draft")
  chip = this_machine({"call_latency_ms": 0.5, "layer_latency_ms": 0.25})
  pod = dataclasses.replace(get_pod("this-machine"), chip=chip)
  c = forward_cost(model, pod, 1, 1, 10, 10)
  assert c.latency == pytest.approx(0.5e-3 + 3 * 0.25e-3)
  for name in ("h100-x8", "tpu-v5p-64", "gb200-x32"):
    assert forward_cost(model, get_pod(name), 1, 1, 10, 10).latency == pytest.approx(30e-6)
  tau, lam = fit([(L, 0.2 + 0.1 * L) for L in (1, 2, 4, 8)])
  assert (tau, lam) == (pytest.approx(0.2), pytest.approx(0.1))


def test_calibration_nemo_rl_within_15_percent():
  got = calibrate.nemo_rl()
  for name, ratio in got["ratio"].items():
    assert abs(ratio - 1) <= 0.15, (name, got["predicted"][name])


def test_unknown_names_list_the_known_ones():
  with pytest.raises(ValueError, match="qwen3-235b-a22b"):
    get_model("qwen3-9000b")
  with pytest.raises(ValueError, match="tpu-v5p-<TensorCores>"):
    get_pod("tpu-v9")
  with pytest.raises(ValueError, match="eagle3"):
    get_drafter("medusa", get_model("qwen3-8b"))


def test_mesh_that_does_not_divide_the_model():
  with pytest.raises(ValueError, match="not divisible by tp=3"):
    project(scenario(hardware="h100-x6", tp=3), ("sync",))


def test_mesh_that_does_not_fit_says_by_how_much_per_chip():
  with pytest.raises(ValueError, match=r"params .* GB \+ optimizer .* GB \+ KV pools .*"
                                       r"short by .* GB per chip"):
    project(scenario(model="qwen3-235b-a22b", hardware="h100-x8", tp=8), ("sync",))


@pytest.mark.parametrize("a, message", [((1.2, 0.5), r"in \[0, 1\]"),
                                        ((-0.1,), r"in \[0, 1\]"),
                                        ((0.5, 0.7), "must not increase")])
def test_bad_acceptance(a, message):
  with pytest.raises(ValueError, match=message):
    acc.validate(a)


def test_cli_writes_json_and_png(tmp_path):
  out = tmp_path / "sim.json"
  res = main(["--model", "qwen3-0.6b", "--hardware", "h100-x2", "--prompts", "4",
              "--group", "4", "--mean-len", "256", "--max-len", "1024", "--steps", "3",
              "--no-sweep", "--out", str(out)])
  assert out.exists() and (tmp_path / "sim.png").exists()
  assert {"step_speedup_sd_sync_vs_ar_sync", "step_speedup_sd_async_vs_ar_sync"} <= set(
      res["summary"])
