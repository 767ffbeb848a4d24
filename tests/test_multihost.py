"""Multi-host training as two ``jax.distributed`` processes on localhost (CPU, gloo), 4
fake devices each, on a global mesh spanning both: the parameters of one process with
the same mesh (AR, a distilled draft model, offloading preemptions), checkpoint and
resume across processes, a killed process stops the other, only process 0 writes the
run directory's files, each process reads only its shards of a HF checkpoint; a setup
that cannot work stops with a clear error before any weight is read."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from spec_rl_jax import checkpoint, distributed
from spec_rl_jax.config import load_config
from spec_rl_jax.rl.metrics import read_metrics
from tests import multihost
from tests.rl_fixtures import tiny_overrides, write_tiny_models

# Each process records, next to its log, the files it opened for writing in the run
# directory (checkpoints aside: orbax coordinates those) and the HF tensor slices it
# read (hf_io logs them at DEBUG level), then trains with a reward that varies within a
# group (the parity of the response's length), so updates move random tiny models.
_MAIN = """
import atexit, json, logging, os, sys
from spec_rl_jax import train
from spec_rl_jax.rl import rewards

record = os.environ["TEST_RECORD"]
run_dir = os.path.abspath(next(a[8:] for a in sys.argv[1:] if a.startswith("run_dir=")))
written = set()

def audit(event, args):
  if event == "open" and isinstance(args[0], str):
    writes = args[2] & (os.O_WRONLY | os.O_RDWR)
  elif event == "os.mkdir" and isinstance(args[0], str):
    writes = True
  else:
    return
  path = os.path.abspath(args[0])
  if writes and path.startswith(run_dir + os.sep):
    rel = os.path.relpath(path, run_dir)
    if rel.split(os.sep)[0] != "ckpt":
      written.add(rel)

sys.addaudithook(audit)
atexit.register(lambda: json.dump(sorted(written), open(record + ".writes", "w")))
reads = logging.getLogger("spec_rl_jax.models.hf_io")
reads.setLevel(logging.DEBUG)
reads.propagate = False
reads.addHandler(logging.FileHandler(record + ".reads"))
rewards.REWARDS["parity"] = lambda response, answer: len(response) % 2
if os.environ.get("TEST_OFFLOAD"):  # KV grows a page at a time, preemption offloads
  import dataclasses
  from spec_rl_jax.rollout import slot_io
  from spec_rl_jax.rollout.scheduler import SchedulerConfig
  engine_config, preempt, modes = train.engine_config, slot_io.SlotIO.preempt, []
  train.engine_config = lambda cfg, eos: dataclasses.replace(
      engine_config(cfg, eos), scheduler=SchedulerConfig("naive", grow_tokens=16))
  slot_io.SlotIO.preempt = lambda self, state, seq, mode, *a: (
      modes.append(mode), preempt(self, state, seq, mode, *a))[1]
  atexit.register(lambda: json.dump(modes, open(record + ".preempted", "w")))
train.main(sys.argv[1:])
"""

_TIMEOUT = 420  # seconds for one run (two processes share 2 CPU cores)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
  return write_tiny_models(str(tmp_path_factory.mktemp("models")))


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
  path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
  path.write_text("".join(f'{{"prompt": "{a}+{b}=", "answer": "{a + b}"}}\n'
                          for a in range(4) for b in range(3)))
  return {"data.sources": f"[jsonl:{path}]", "data.default_reward": "parity"}


def _args(models, run_dir, prompts, **extra) -> list[str]:
  """A tiny run of 2 AR steps on mesh (1, 4, 2), a checkpoint after each."""
  return tiny_overrides(models, str(run_dir), **{
      "steps": 2, "checkpoint.every": 1, "drafter.num_draft_tokens": 0, "learner.lr": 1e-2,
      "policy.mesh": "[1,4,2]", **prompts, **extra})


def _start(root, name, args, processes, resume=False):
  """Starts ``args`` as ``processes`` joined processes of ``8 / processes`` devices
  (0: one process of 8 devices without ``jax.distributed``); returns them and their
  log directory (logs and records ``i.log``, ``i.writes``, ``i.reads``)."""
  logs = root / f"{name}-logs"
  logs.mkdir(exist_ok=True)
  args = ["--resume", *args] if resume else args
  record = lambda i: {"TEST_RECORD": str(logs / str(i))}  # noqa: E731
  if processes == 0:
    with open(logs / "0.log", "w") as log:
      return [subprocess.Popen([sys.executable, "-c", _MAIN, *args], stdout=log,
                               stderr=subprocess.STDOUT,
                               env=multihost.env(8, "", **record(0)))], logs
  return multihost.start(_MAIN, [*args, "policy.distributed=true"], processes,
                         8 // processes, "", str(logs), record), logs


def _train(root, name, args, processes, resume=False):
  """Runs to completion; returns the log directory."""
  procs, logs = _start(root, name, args, processes, resume)
  codes = multihost.wait(procs, _TIMEOUT)
  for i, code in enumerate(codes):
    assert code == 0, multihost.log(str(logs), i)[-3000:]
  return logs


def _final_params(run_dir, key="params") -> tuple[int, list[np.ndarray]]:
  """The last checkpoint's step and its policy's (``key="draft"``: its draft model's)
  parameters."""
  ckpt = checkpoint.TrainCheckpointer(str(run_dir))
  meta = ckpt.restore_meta()
  model = meta["model" if key == "params" else "draft_model"]
  _, abstract = checkpoint.abstract_params(checkpoint.config_from_json(model))
  params = [np.asarray(x) for x in jax.tree.leaves(ckpt.restore_params(abstract, key=key))]
  step = ckpt.latest_step()
  ckpt.close()
  return step, params


def _assert_same(a, b, atol=0.0):
  for x, y in zip(a, b, strict=True):
    np.testing.assert_allclose(x, y, rtol=0, atol=atol)


@pytest.fixture(scope="module")
def two_processes(models, prompts, tmp_path_factory):
  """``(run directory, log directory)`` of the tiny run as two processes."""
  root = tmp_path_factory.mktemp("two")
  return root / "run", _train(root, "run", _args(models, root / "run", prompts), 2)


# ---------------------------------------------------------------- setups that cannot run


@pytest.mark.parametrize("env,message", [
    ({"JAX_COORDINATOR_ADDRESS": "localhost:1234"},
     r"JAX_NUM_PROCESSES, JAX_PROCESS_ID missing from the environment"),
    ({"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"},
     r"JAX_COORDINATOR_ADDRESS missing from the environment"),
    ({"JAX_COORDINATOR_ADDRESS": "localhost:1234", "JAX_NUM_PROCESSES": "two",
      "JAX_PROCESS_ID": "0"}, r"JAX_NUM_PROCESSES='two' is not an integer"),
    ({"JAX_COORDINATOR_ADDRESS": "localhost:1234", "JAX_NUM_PROCESSES": "2",
      "JAX_PROCESS_ID": "2"}, r"JAX_PROCESS_ID=2 outside \[0, JAX_NUM_PROCESSES = 2\)"),
])
def test_incomplete_environment(monkeypatch, env, message):
  for name in distributed.ENV_VARS:
    monkeypatch.delenv(name, raising=False)
  for name, value in env.items():
    monkeypatch.setenv(name, value)
  with pytest.raises(distributed.DistributedSetupError, match=message):
    distributed.initialize()


def test_async_rl_is_one_process_only(monkeypatch):
  """Async RL's two threads would launch device programs in another order on each
  process (the config check, as process 0 of two sees it)."""
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  cfg = load_config(None, ["policy.mesh=[2,2,2]", "rl.mode=async"])
  with pytest.raises(ValueError, match=r"rl.mode='async' runs on one process only"):
    distributed.check_run(cfg)
  distributed.check_run(load_config(None, ["policy.mesh=[2,2,2]"]))


def test_no_cluster_and_no_environment(monkeypatch):
  """Without the variables, jax's own cluster detection finds nothing here: the error
  names the variables to set."""
  for name in distributed.ENV_VARS:
    monkeypatch.delenv(name, raising=False)

  def undetected(**kw):  # what jax.distributed.initialize() raises outside a known cluster
    raise ValueError("coordinator_address should be defined.")

  monkeypatch.setattr(jax.distributed, "initialize", undetected)
  with pytest.raises(distributed.DistributedSetupError,
                     match=r"set JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID in"
                           r" every process's environment"):
    distributed.initialize()


def test_a_mesh_short_of_the_devices_stops_before_any_weight_is_read(tmp_path):
  """Two processes of 4 devices with a mesh of 4: each exits with a clear error before
  reading a weight (the policy path does not even exist)."""
  models = {k: str(tmp_path / "absent" / k) for k in ("policy", "draft", "eagle3", "mtp")}
  args = tiny_overrides(models, str(tmp_path / "run"), **{"policy.mesh": "[1,2,2]"})
  procs, logs = _start(tmp_path, "mesh", args, 2)
  assert all(code != 0 for code in multihost.wait(procs, 120))
  for i in range(2):
    assert ("policy.mesh [1, 2, 2] spans 4 devices but the 2 processes hold 8 (4 in this"
            " one)") in multihost.log(str(logs), i)
    assert os.path.getsize(logs / f"{i}.reads") == 0


# ---------------------------------------------------------------- training


@pytest.mark.slow
def test_two_processes_train_as_one(models, prompts, two_processes, tmp_path):
  """The same parameters as one process of 8 devices on the same mesh: bit for bit
  with the same (gloo) collectives, to float rounding with the in-process ones (their
  sums run in another order)."""
  run_dir, _ = two_processes
  step, params = _final_params(run_dir)
  assert step == 2
  _train(tmp_path, "one", _args(models, tmp_path / "one", prompts), 1)
  _assert_same(params, _final_params(tmp_path / "one")[1])
  _train(tmp_path, "plain", _args(models, tmp_path / "plain", prompts), 0)
  _assert_same(params, _final_params(tmp_path / "plain")[1], atol=1e-4)
  records = read_metrics(str(run_dir))
  assert [r["step"] for r in records] == [1, 2]
  assert any(r["train/loss"] != 0 for r in records)
  assert ([r["rollout/reward_mean"] for r in records]
          == [r["rollout/reward_mean"] for r in read_metrics(str(tmp_path / "plain"))])


@pytest.mark.slow
def test_only_process_0_writes_and_each_reads_its_shards(models, two_processes):
  """Process 0 writes the resolved config, the metrics, TensorBoard and the plots;
  process 1 writes nothing outside the checkpoints. Each reads only the slices of the
  policy's safetensors its devices hold: on mesh (1, 4, 2) the ``fsdp`` axis splits
  the model dimension between the processes."""
  _, logs = two_processes
  writes = [set(json.loads((logs / f"{i}.writes").read_text())) for i in range(2)]
  assert writes[1] == set()
  assert {"config.yaml", "metrics.jsonl", "reward.png", "timeline.png"} <= writes[0]
  assert any(w.startswith("tb" + os.sep) for w in writes[0])

  pattern = re.compile(r"^(.*): read (\S+) (\[.*\])$")
  reads = []
  for i in range(2):
    lines = [pattern.match(line) for line in (logs / f"{i}.reads").read_text().splitlines()]
    reads.append({(m[2], tuple(map(tuple, json.loads(m[3].replace("(", "[")
                                                   .replace(")", "]")))))
                  for m in lines if m[1] == models["policy"]})
  embed = [[s[1] for name, s in r if name == "model.embed_tokens.weight"] for r in reads]
  assert {c for c in embed[0]} == {(0, 16), (16, 32)}  # D = 64 over 4 fsdp shards
  assert {c for c in embed[1]} == {(32, 48), (48, 64)}
  size = lambda r: sum(int(np.prod([b - a for a, b in s])) for _, s in r)  # noqa: E731
  total = sum(int(np.prod(v.shape)) for v in _final_params(two_processes[0])[1])
  for r in reads:  # about half, the replicated norms in full
    assert 0.45 * total < size(r) < 0.55 * total


@pytest.mark.slow
def test_resume_across_processes(models, prompts, two_processes, tmp_path):
  """Stopped after step 1's checkpoint and resumed, again as two processes: the
  uninterrupted run's parameters, bit for bit."""
  run_dir = tmp_path / "run"
  _train(tmp_path, "first", _args(models, run_dir, prompts, steps=1), 2)
  assert _final_params(run_dir)[0] == 1
  _train(tmp_path, "resumed", _args(models, run_dir, prompts), 2, resume=True)
  step, params = _final_params(run_dir)
  assert step == 2
  _assert_same(params, _final_params(two_processes[0])[1])
  assert [r["step"] for r in read_metrics(str(run_dir))] == [1, 2]


@pytest.mark.slow
def test_draft_model_rollouts_on_two_processes(models, prompts, tmp_path):
  """Speculative rollouts by a draft model, distilled every step, on the two
  processes' mesh: the one-process policy and drafter, bit for bit."""
  extra = {"drafter.num_draft_tokens": 2, "drafter.train.every": 1}
  _train(tmp_path, "two", _args(models, tmp_path / "two", prompts, **extra), 2)
  _train(tmp_path, "one", _args(models, tmp_path / "one", prompts, **extra), 1)
  for key in ("params", "draft"):
    _assert_same(_final_params(tmp_path / "two", key)[1],
                 _final_params(tmp_path / "one", key)[1])
  assert all(r["spec/acceptance_length"] > 1 for r in read_metrics(str(tmp_path / "two")))


@pytest.mark.slow
@pytest.mark.parametrize("proposer", ["ngram", "self_sparse", "mtp", "eagle3"])
def test_other_proposers_on_two_processes(models, prompts, tmp_path, proposer):
  """The model-free drafts and the heads (loaded whole on every process, then copied
  onto the mesh) on the two processes' mesh: the one-process policy, bit for bit."""
  extra = {"drafter.proposer": proposer, "drafter.num_draft_tokens": 2}
  _train(tmp_path, "two", _args(models, tmp_path / "two", prompts, **extra), 2)
  _train(tmp_path, "one", _args(models, tmp_path / "one", prompts, **extra), 1)
  _assert_same(_final_params(tmp_path / "two")[1], _final_params(tmp_path / "one")[1])


@pytest.mark.slow
def test_offloaded_preemptions_on_two_processes(models, prompts, tmp_path, monkeypatch):
  """A KV budget short of the batch's: sequences preempted (their KV pages copied to
  host memory on every process, the same preemptions on both) and restored give the
  one-process parameters, bit for bit."""
  monkeypatch.setenv("TEST_OFFLOAD", "1")
  extra = {"rollout.num_pages": 8, "rollout.max_new_tokens": 40}
  logs = {n: _train(tmp_path, n, _args(models, tmp_path / n, prompts, **extra), p)
          for n, p in (("two", 2), ("one", 1))}
  preempted = [json.loads((logs["two"] / f"{i}.preempted").read_text()) for i in range(2)]
  assert preempted[0] == preempted[1] == json.loads((logs["one"] / "0.preempted").read_text())
  assert preempted[0] and set(preempted[0]) == {"offload"}
  _assert_same(_final_params(tmp_path / "two")[1], _final_params(tmp_path / "one")[1])


@pytest.mark.slow
@pytest.mark.parametrize("victim", [0, 1])
def test_a_killed_process_stops_the_other(models, prompts, tmp_path, monkeypatch, victim):
  """SIGKILL one process mid-run (the coordinator, or the other): the survivor exits
  with jax's message naming the cause, within the heartbeat timeout, instead of
  waiting in a collective or a checkpoint barrier."""
  monkeypatch.setenv(distributed.HEARTBEAT_VAR, "20")
  run_dir = tmp_path / "run"
  procs, logs = _start(tmp_path, "run", _args(models, run_dir, prompts, steps=100), 2)
  metrics = run_dir / "metrics.jsonl"
  deadline = time.monotonic() + _TIMEOUT
  while not (metrics.exists() and metrics.read_text()):  # a step done: the run is going
    assert all(p.poll() is None for p in procs), multihost.log(str(logs), 0)[-3000:]
    assert time.monotonic() < deadline
    time.sleep(0.1)
  procs[victim].send_signal(signal.SIGKILL)
  survivor = 1 - victim
  code = multihost.wait([procs[survivor]], 60)[0]
  procs[victim].wait()
  assert code != 0
  assert ("Terminating process because the JAX distributed service detected fatal"
          " errors") in multihost.log(str(logs), survivor)
