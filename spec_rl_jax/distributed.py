"""Multi-process runs: joining ``jax.distributed``, checking the config against it.

Every process of a multi-host run executes the same program (SPMD): the same host loop,
the same jitted calls in the same order, each process feeding and reading back only
its own devices' shards. `initialize` joins the processes before anything touches a
device; `check_run` stops a config a multi-process run cannot follow (a mesh that
leaves a process's devices out, async RL) before any weight is loaded.

Where the processes come from:

  * ``JAX_COORDINATOR_ADDRESS`` (``host:port`` of process 0), ``JAX_NUM_PROCESSES`` and
    ``JAX_PROCESS_ID`` in every process's environment (any launcher, or by hand on
    one machine);
  * with none of them set, what ``jax.distributed.initialize()`` detects by itself: a
    Cloud TPU slice, SLURM, Open MPI, and the other clusters jax knows.

A process that dies takes the run down: jax's coordination service notices the lost
process, at the latest when its heartbeats have been missing for
``SPEC_RL_JAX_HEARTBEAT_TIMEOUT_S`` seconds (default: jax's, 100), and terminates every
other process with "Terminating process because the JAX distributed service detected
fatal errors", instead of leaving them waiting in a collective or a checkpoint barrier.
A shorter timeout stops a broken run sooner; it must exceed the longest time a healthy
host can go silent.
"""

from __future__ import annotations

import os

import jax
import numpy as np

from spec_rl_jax.config import TrainConfig

ENV_VARS = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
HEARTBEAT_VAR = "SPEC_RL_JAX_HEARTBEAT_TIMEOUT_S"


class DistributedSetupError(RuntimeError):
  """The processes of a multi-host run cannot be joined as configured."""


def _int_var(name: str) -> int:
  value = os.environ[name]
  try:
    return int(value)
  except ValueError:
    raise DistributedSetupError(f"{name}={value!r} is not an integer") from None


def initialize() -> None:
  """Joins this process to the run's others (``policy.distributed: true``); call it
  before any other jax call. Raises `DistributedSetupError` naming the environment
  variables that are missing or malformed."""
  timeouts = ({"heartbeat_timeout_seconds": _int_var(HEARTBEAT_VAR)}
              if os.environ.get(HEARTBEAT_VAR) else {})
  missing = [k for k in ENV_VARS if not os.environ.get(k)]
  if missing and len(missing) < len(ENV_VARS):
    raise DistributedSetupError(
        f"policy.distributed=true: {', '.join(missing)} missing from the environment"
        f" (set all of {', '.join(ENV_VARS)}, or none of them on a cluster jax detects by"
        " itself, such as a Cloud TPU slice)")
  if missing:
    try:
      jax.distributed.initialize(**timeouts)
    except ValueError as e:
      raise DistributedSetupError(
          f"policy.distributed=true but this is no cluster jax detects by itself ({e}):"
          f" set {', '.join(ENV_VARS)} in every process's environment (process 0's"
          " host:port, the number of processes, this process's index)") from None
    return
  count, index = _int_var("JAX_NUM_PROCESSES"), _int_var("JAX_PROCESS_ID")
  if not 0 <= index < count:
    raise DistributedSetupError(f"JAX_PROCESS_ID={index} outside [0, JAX_NUM_PROCESSES ="
                                f" {count})")
  jax.distributed.initialize(os.environ["JAX_COORDINATOR_ADDRESS"], count, index, **timeouts)


def check_run(cfg: TrainConfig) -> None:
  """What a multi-process run needs of its config: ``policy.mesh`` over every
  process's devices, and sync RL. Every process must launch the same device programs
  in the same order (their collectives pair up by order); async RL launches rollouts
  and updates from two threads, in an order that differs between processes."""
  if jax.process_count() == 1:
    return
  shape = cfg.policy.mesh
  n, total = int(np.prod(shape)), jax.device_count()
  if n != total:
    raise ValueError(
        f"policy.mesh {list(shape)} spans {n} devices but the {jax.process_count()}"
        f" processes hold {total} ({jax.local_device_count()} in this one): a multi-process"
        f" mesh must span them all (its axes' product = {total})")
  if cfg.rl.mode != "sync":
    raise ValueError(f"rl.mode={cfg.rl.mode!r} runs on one process only: its rollout and"
                     " learner threads would launch device programs in a different order"
                     " on each process; use rl.mode=sync for a multi-process run")


def is_writer() -> bool:
  """Whether this process writes the run directory's files (process 0; orbax
  checkpoints coordinate their own writes across processes)."""
  return jax.process_index() == 0
