"""Runs a program as several ``jax.distributed`` processes on localhost (CPU devices,
gloo collectives), each with its own fake devices, the way a multi-host launcher
starts one process per host: the same command, ``JAX_COORDINATOR_ADDRESS``,
``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID`` in the environment."""

import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def env(devices: int, xla_cache: str, **extra: str) -> dict[str, str]:
  """The test process's environment (its compile flags) with ``devices`` fake CPU
  devices and its own persistent XLA cache (``""``: none)."""
  flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "",
                 os.environ.get("XLA_FLAGS", ""))
  return {**os.environ, "JAX_PLATFORMS": "cpu", "SPEC_RL_JAX_XLA_CACHE": xla_cache,
          "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count={devices}",
          **extra}


def start(code: str, args: list[str], processes: int, devices: int, xla_cache: str,
          log_dir: str, process_env: Callable[[int], dict[str, str]] = lambda i: {}
          ) -> list[subprocess.Popen]:
  """``python -c code *args`` as ``processes`` joined processes of ``devices`` devices
  each, process i with ``process_env(i)`` added to its environment; its stdout and
  stderr go to ``log_dir/i.log``."""
  address = f"localhost:{free_port()}"
  procs = []
  for i in range(processes):
    with open(os.path.join(log_dir, f"{i}.log"), "w") as log:
      procs.append(subprocess.Popen(
          [sys.executable, "-c", code, *args], stdout=log, stderr=subprocess.STDOUT,
          env=env(devices, xla_cache, JAX_COORDINATOR_ADDRESS=address,
                  JAX_NUM_PROCESSES=str(processes), JAX_PROCESS_ID=str(i),
                  **process_env(i))))
  return procs


def wait(procs: list[subprocess.Popen], timeout: float) -> list[int]:
  """The processes' exit codes; kills them all (and fails) past ``timeout`` seconds."""
  deadline = time.monotonic() + timeout
  try:
    return [p.wait(timeout=max(deadline - time.monotonic(), 0)) for p in procs]
  except subprocess.TimeoutExpired:
    for p in procs:
      p.kill()
      p.wait()
    raise AssertionError(f"processes still running after {timeout} s") from None


def log(log_dir: str, i: int) -> str:
  with open(os.path.join(log_dir, f"{i}.log")) as f:
    return f.read()
