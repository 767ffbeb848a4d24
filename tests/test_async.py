"""Asynchronous RL on one mesh (rl/pipeline.py): the staleness schedule, async with
max_staleness 0 is the sync run bit for bit, the bound and the parameters do not depend
on timing, failures of either thread stop the run, resume regenerates in-flight
rollouts exactly."""

import os
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest

from spec_rl_jax import checkpoint, train
from spec_rl_jax.config import ConfigError, load_config
from spec_rl_jax.rl import rewards
from spec_rl_jax.rl.learner import Learner
from spec_rl_jax.rl.metrics import plot_timeline, read_metrics
from spec_rl_jax.rl.pipeline import RolloutThreadError, Schedule
from tests.rl_fixtures import tiny_overrides, write_tiny_models


@pytest.fixture(scope="module")
def models(tmp_path_factory):
  return write_tiny_models(str(tmp_path_factory.mktemp("models")))


@pytest.fixture
def parity_prompts(tmp_path, monkeypatch):
  """A JSONL source whose reward is the parity of the response's length: random tiny
  models get rewards that vary within a group, so updates move the policy."""
  monkeypatch.setitem(rewards.REWARDS, "parity", lambda response, answer: len(response) % 2)
  path = tmp_path / "prompts.jsonl"
  path.write_text("".join(f'{{"prompt": "{a}+{b}=", "answer": "{a + b}"}}\n'
                          for a in range(4) for b in range(3)))
  return {"data.sources": f"[jsonl:{path}]", "data.default_reward": "parity"}


def _config(models, run_dir, prompts, **extra):
  """A tiny run of 4 AR steps, a checkpoint after the last."""
  overrides = {"steps": 4, "checkpoint.every": 4, "drafter.num_draft_tokens": 0,
               "learner.lr": 1e-2, **prompts, **extra}
  return load_config(None, tiny_overrides(models, str(run_dir), **overrides))


def _run(models, run_dir, prompts, resume=False, **extra):
  """``(final parameters as host arrays, metrics records)`` of `_config`'s run."""
  trainer = train.Trainer(_config(models, run_dir, prompts, **extra), resume=resume)
  try:
    trainer.run()
  finally:
    trainer.close()
  return ([np.asarray(x) for x in jax.tree.leaves(trainer.learner.state["params"])],
          read_metrics(str(run_dir)))


def _assert_same_params(a, b):
  for x, y in zip(a, b, strict=True):
    np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("override,message", [
    ("rl.max_staleness=-1", r"rl.max_staleness must be >= 0, got -1"),
    ("rl.max_staleness=2", r"rl.max_staleness=2 needs rl.mode=async"),
    ("rl.mode=overlap", r"rl.mode='overlap' is not one of \['async', 'sync'\]"),
    ("learner.importance_cap=0", r"learner.importance_cap must be > 0, got 0.0"),
    ("learner.importance_cap=-2.5", r"learner.importance_cap must be > 0, got -2.5"),
])
def test_bad_config(override, message):
  with pytest.raises(ConfigError, match=message):
    load_config(None, ["rl.mode=async", override] if "needs" not in message
                else [override])


def test_schedule_is_a_function_of_the_step():
  """v(t) = max(t - N, the last barrier <= t); the run's first step is a barrier."""
  every4 = lambda s: s % 4 == 0  # noqa: E731
  assert [Schedule(0, 10, 0, every4).version(t) for t in range(10)] == list(range(10))
  assert [Schedule(0, 10, 1, every4).version(t) for t in range(10)] == [
      0, 0, 1, 2, 4, 4, 5, 6, 8, 8]
  assert [Schedule(0, 10, 2, every4).version(t) for t in range(10)] == [
      0, 0, 0, 1, 4, 4, 4, 5, 8, 8]
  assert [Schedule(5, 10, 3, every4).version(t) for t in range(5, 10)] == [5, 5, 5, 8, 8]


def test_timeline_plot(tmp_path):
  path = plot_timeline(str(tmp_path / "timeline.png"), {
      "rollout": [[0, 10.0, 10.5], [1, 10.5, 11.2], [2, 11.2, float("inf")]],
      "update": [[0, 10.6, 10.9]]})
  assert os.path.getsize(path) > 0


@pytest.mark.slow
def test_async_staleness_zero_is_the_sync_run(models, tmp_path, parity_prompts):
  """Same rollouts, same parameters, bit for bit, with decoupled PPO in async mode
  (staleness 0: behaviour = proximal, w = 1) against PPO-clip in sync mode."""
  sync, sync_records = _run(models, tmp_path / "sync", parity_prompts)
  async0, async_records = _run(models, tmp_path / "async", parity_prompts,
                               **{"rl.mode": "async", "learner.loss": "decoupled_ppo"})
  _assert_same_params(sync, async0)
  assert any(r["train/loss"] != 0 for r in sync_records)  # the policy did move
  for s, a in zip(sync_records, async_records, strict=True):
    assert s["rollout/reward_mean"] == a["rollout/reward_mean"]
    assert s["train/loss"] == a["train/loss"]
    assert a["rl/staleness_max"] == 0 and a["train/iw_mean"] == 1.0


def _timed(monkeypatch, owner, name, delay, events, kind):
  """Wraps ``owner.name`` to sleep ``delay`` seconds first, logging ``(kind, start,
  end)``."""
  inner = getattr(owner, name)

  def wrapper(*args, **kw):
    start = time.perf_counter()
    time.sleep(delay)
    out = inner(*args, **kw)
    events.append((kind, start, time.perf_counter()))
    return out

  monkeypatch.setattr(owner, name, wrapper)


@pytest.mark.slow
@pytest.mark.parametrize("slow", ["rollouts", "updates"])
def test_staleness_bound_and_params_do_not_depend_on_timing(models, tmp_path,
                                                            parity_prompts, monkeypatch,
                                                            slow):
  """max_staleness 2: slow rollouts (the learner waits) or slow updates (the rollout
  thread runs ahead as far as it may) change neither any batch's staleness nor the
  parameters; with slow updates the next rollouts overlap the update."""
  async2 = {"rl.mode": "async", "rl.max_staleness": 2, "learner.loss": "decoupled_ppo"}
  reference, records = _run(models, tmp_path / "reference", parity_prompts, **async2)
  # v(t) = 0, 0, 0, 1: staleness 0, 1, 2, 2 (a checkpoint after step 4 only).
  assert [r["rl/staleness_max"] for r in records] == [0, 1, 2, 2]
  assert [r["rl/staleness_hist"] for r in records] == [[1, 0, 0], [0, 1, 0], [0, 0, 1],
                                                       [0, 0, 1]]
  assert all(r["train/iw_max"] <= 5.0 and r["train/iw_mean"] > 0 for r in records)
  assert records[-1]["train/iw_mean"] != 1.0  # stale tokens: π_prox ≠ π_behav

  events = []
  _timed(monkeypatch, train.Trainer, "rollout", 0.4 if slow == "rollouts" else 0.0,
         events, "rollout")
  _timed(monkeypatch, Learner, "update", 0.4 if slow == "updates" else 0.0, events, "update")
  params, timed_records = _run(models, tmp_path / slow, parity_prompts, **async2)
  _assert_same_params(reference, params)
  assert [r["rl/staleness_max"] for r in timed_records] == [0, 1, 2, 2]
  rollouts = [e for e in events if e[0] == "rollout"]
  updates = [e for e in events if e[0] == "update"]
  if slow == "updates":  # rollouts of steps 2 and 3 start before update 1 ends
    assert rollouts[2][1] < updates[0][2]
    assert max(r["time/learner_idle_frac"] for r in timed_records[1:]) < 0.5


def test_a_dying_rollout_thread_stops_the_run(models, tmp_path, parity_prompts,
                                              monkeypatch):
  """The learner raises the rollout thread's exception (as the cause) instead of
  waiting; the last checkpoint stays the resume point; no thread is left behind."""
  _fail_scoring(monkeypatch, call=3)
  run_dir = tmp_path / "run"
  outcome = {}

  def target():
    try:
      _run(models, run_dir, parity_prompts, steps=6, **{
          "checkpoint.every": 2, "rl.mode": "async", "rl.max_staleness": 1})
    except BaseException as e:  # noqa: BLE001
      outcome["error"] = e

  thread = threading.Thread(target=target)
  thread.start()
  thread.join(timeout=120)
  assert not thread.is_alive(), "the trainer hangs after its rollout thread died"
  error = outcome["error"]
  assert isinstance(error, RolloutThreadError)
  assert isinstance(error.__cause__, OSError) and "disk on fire" in str(error.__cause__)
  assert error.__cause__.__traceback__ is not None
  assert not [t for t in threading.enumerate() if t.name == "rollouts"]
  ckpt = checkpoint.TrainCheckpointer(str(run_dir))
  assert ckpt.all_steps() == [2, 3]  # the 3 updates made before the failure are kept
  ckpt.close()
  _, records = _run(models, run_dir, parity_prompts, resume=True, steps=6, **{
      "checkpoint.every": 2, "rl.mode": "async", "rl.max_staleness": 1})
  assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
  # Step 4 regenerates its rollouts after the resume (a barrier), step 5 after the
  # checkpoint at 4: both fresh.
  assert [r["rl/staleness_max"] for r in records] == [0, 1, 0, 0, 0, 1]


def _fail_scoring(monkeypatch, call: int) -> None:
  """The rollouts' scoring raises on its ``call``-th call (from 0), once: after the
  step's batch is drawn and generated."""
  inner, calls = train.score_batch, []

  def failing(*args, **kw):
    calls.append(None)
    if len(calls) == call + 1:
      raise OSError("disk on fire")
    return inner(*args, **kw)

  monkeypatch.setattr(train, "score_batch", failing)


def test_failed_rollouts_checkpoint_then_resume_as_uninterrupted(models, tmp_path,
                                                                  parity_prompts,
                                                                  monkeypatch):
  """Sync: rollouts failing at step 4 (after a checkpoint at step 2) leave a checkpoint
  of the 3 updates made with the data stream at step 4's batch; resumed, the run ends
  with the uninterrupted run's parameters, bit for bit."""
  every2 = {"steps": 5, "checkpoint.every": 2}
  straight, _ = _run(models, tmp_path / "straight", parity_prompts, **every2)
  _fail_scoring(monkeypatch, call=3)
  with pytest.raises(OSError, match="disk on fire"):
    _run(models, tmp_path / "failed", parity_prompts, **every2)
  ckpt = checkpoint.TrainCheckpointer(str(tmp_path / "failed"))
  assert ckpt.all_steps() == [2, 3]
  ckpt.close()
  resumed, records = _run(models, tmp_path / "failed", parity_prompts, resume=True,
                          **every2)
  assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
  _assert_same_params(straight, resumed)


@pytest.mark.slow
def test_a_failing_update_stops_the_rollout_thread(models, tmp_path, parity_prompts,
                                                   monkeypatch):
  def failing(self, batch, train_draft=False):
    raise FloatingPointError("update failed")

  monkeypatch.setattr(Learner, "update", failing)
  with pytest.raises(FloatingPointError, match="update failed"):
    _run(models, tmp_path / "run", parity_prompts,
         **{"rl.mode": "async", "rl.max_staleness": 1})
  assert not [t for t in threading.enumerate() if t.name == "rollouts"]


@pytest.mark.slow
def test_resume_regenerates_in_flight_rollouts_exactly(models, tmp_path, parity_prompts):
  """Stopped after step 2 (a checkpoint: a barrier) and resumed, an async run ends with
  the parameters of the uninterrupted run."""
  async1 = {"rl.mode": "async", "rl.max_staleness": 1, "learner.loss": "decoupled_ppo",
            "checkpoint.every": 2}
  straight, records = _run(models, tmp_path / "straight", parity_prompts, **async1)
  assert [r["rl/staleness_max"] for r in records] == [0, 1, 0, 1]
  _run(models, tmp_path / "killed", parity_prompts, **{**async1, "steps": 2})
  resumed, resumed_records = _run(models, tmp_path / "killed", parity_prompts, resume=True,
                                  **async1)
  assert [r["step"] for r in resumed_records] == [1, 2, 3, 4]
  for a, b in zip(records, resumed_records, strict=True):
    assert (a["rollout/reward_mean"], a["train/loss"], a["rl/staleness_max"]) == (
        b["rollout/reward_mean"], b["train/loss"], b["rl/staleness_max"])
  _assert_same_params(straight, resumed)


_PARITY_MAIN = """
import sys
from spec_rl_jax import train
from spec_rl_jax.rl import rewards
rewards.REWARDS["parity"] = lambda response, answer: len(response) % 2
train.main(sys.argv[1:])
"""


def _final_checkpoint(run_dir):
  """The last checkpoint's policy and draft-model parameters, host arrays."""
  ckpt = checkpoint.TrainCheckpointer(run_dir)
  meta = ckpt.restore_meta()
  out = []
  for key, model in (("params", "model"), ("draft", "draft_model")):
    _, abstract = checkpoint.abstract_params(checkpoint.config_from_json(meta[model]))
    out += [np.asarray(x) for x in jax.tree.leaves(ckpt.restore_params(abstract, key=key))]
  step = ckpt.latest_step()
  ckpt.close()
  return step, out


@pytest.mark.slow
def test_sigkill_then_resume_matches_uninterrupted(models, tmp_path, parity_prompts):
  """An async run (staleness 1, speculative rollouts by a draft model distilled every
  step) SIGKILLed once its step-2 checkpoint exists, then resumed, ends with the
  uninterrupted run's policy and drafter, bit for bit."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "SPEC_RL_JAX_XLA_CACHE": str(tmp_path / "xla")}
  extra = {"steps": 6, "checkpoint.every": 2, "drafter.num_draft_tokens": 2,
           "drafter.train.every": 1, "learner.lr": 1e-2, "rl.mode": "async",
           "rl.max_staleness": 1, "learner.loss": "decoupled_ppo", **parity_prompts}
  cmd = lambda run_dir, *flags: [sys.executable, "-c", _PARITY_MAIN, *flags,  # noqa: E731
                                 *tiny_overrides(models, str(run_dir), **extra)]
  reference = subprocess.Popen(cmd(tmp_path / "straight"), env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
  killed = tmp_path / "killed"
  proc = subprocess.Popen(cmd(killed), env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE)
  ckpt_dir = killed / "ckpt"
  deadline = time.time() + 240
  while not (ckpt_dir.is_dir() and "2" in os.listdir(ckpt_dir)):
    assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
    assert time.time() < deadline
    time.sleep(0.05)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  assert "6" not in os.listdir(ckpt_dir)  # really killed mid-way
  resumed = subprocess.run(cmd(killed, "--resume"), env=env, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE)
  assert resumed.returncode == 0, resumed.stderr.decode()[-2000:]
  assert reference.wait() == 0, reference.stderr.read().decode()[-2000:]
  (step_a, a), (step_b, b) = _final_checkpoint(tmp_path / "straight"), _final_checkpoint(killed)
  assert step_a == step_b == 6
  _assert_same_params(a, b)
  staleness = [r["rl/staleness_max"] for r in read_metrics(str(killed))]
  assert staleness == [0, 1, 0, 1, 0, 1]


@pytest.mark.slow
@pytest.mark.mesh
def test_async_on_one_mesh_of_8_devices(models, tmp_path, parity_prompts):
  """Placement (a), rollouts and updates sharing a (2, 2, 2) mesh: async with staleness
  0 is the sync run bit for bit; with staleness 1 an evaluation step is a barrier (its
  rollouts fresh) and the final evaluation sees the final weights."""
  mesh = {"policy.mesh": "[2,2,2]"}
  sync, _ = _run(models, tmp_path / "sync", parity_prompts, **mesh)
  async0, _ = _run(models, tmp_path / "async0", parity_prompts, **mesh,
                   **{"rl.mode": "async"})
  _assert_same_params(sync, async0)
  trainer = train.Trainer(_config(models, tmp_path / "async1", parity_prompts, **mesh, **{
      "rl.mode": "async", "rl.max_staleness": 1, "learner.loss": "decoupled_ppo",
      "data.eval_n": 2, "data.eval_k": 1, "data.eval_every": 2}))
  try:
    summary = trainer.run()
  finally:
    trainer.close()
  records = read_metrics(str(tmp_path / "async1"))
  assert [r["rl/staleness_max"] for r in records if "rl/staleness_max" in r] == [0, 1, 0, 1]
  assert "eval_after" in summary and any("eval/" in k for k in records[2])
  assert trainer.engine.version == 4
  assert os.path.basename(summary["timeline"]) == "timeline.png"
  assert [iv[0] for iv in trainer.pipeline.rollouts] == [0, 1, 2, 3]
  assert [iv[0] for iv in trainer.pipeline.updates] == [0, 1, 2, 3]


def _devices(tree) -> set[int]:
  return {d.id for x in jax.tree.leaves(tree) for d in x.sharding.device_set}


_DISJOINT = {"policy.mesh": "[1,2,2]", "rollout.mesh": "[1,2,2]", "rl.mode": "async",
             "learner.loss": "decoupled_ppo"}


@pytest.mark.mesh
def test_disjoint_sub_meshes(models, tmp_path, parity_prompts):
  """Placement (b): the learner on a (1, 2, 2) mesh over devices 0-3, the engine on one
  over devices 4-7, weights copied across after every update: with staleness 1 the
  bound holds and each side stays on its devices."""
  trainer = train.Trainer(_config(models, tmp_path / "async1", parity_prompts,
                                  **_DISJOINT, **{"rl.max_staleness": 1}))
  try:
    trainer.run()
  finally:
    trainer.close()
  records = read_metrics(str(tmp_path / "async1"))
  assert [r["rl/staleness_max"] for r in records] == [0, 1, 1, 1]
  assert _devices(trainer.learner.state["params"]) == {0, 1, 2, 3}
  assert _devices((trainer.engine.state.cache.layers, trainer.engine.state.history)) == {
      4, 5, 6, 7}
  assert trainer.engine.version == 4


@pytest.mark.slow
@pytest.mark.mesh
def test_disjoint_sub_meshes_match_one_shared_mesh(models, tmp_path, parity_prompts):
  """Async with staleness 0 on disjoint sub-meshes is the sync run on one shared
  (1, 2, 2) mesh (placement (a)), bit for bit."""
  shared, _ = _run(models, tmp_path / "shared", parity_prompts, **{"policy.mesh": "[1,2,2]"})
  async0, _ = _run(models, tmp_path / "async0", parity_prompts, **_DISJOINT)
  _assert_same_params(shared, async0)


@pytest.mark.parametrize("extra,message", [
    ({"rollout.mesh": "[1,2,4]"}, r"need 12 devices, only 8 present"),
    ({"rollout.mesh": "[1,1,2]", "rollout.first_device": 2},
     r"from device 2 overlaps policy.mesh \(1, 2, 2\) \(devices 0..3\)"),
])
def test_bad_placement_stops_before_loading(tmp_path, extra, message):
  """A placement that overlaps or asks for absent devices stops before any weight is
  loaded (the policy path does not even exist)."""
  cfg = load_config(None, [f"run_dir={tmp_path}", "policy.path=/nonexistent",
                           "policy.mesh=[1,2,2]", *(f"{k}={v}" for k, v in extra.items())])
  with pytest.raises(ValueError, match=message):
    train.Trainer(cfg)
