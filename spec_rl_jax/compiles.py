"""Compiles: what a block of code compiles (`CompileCounter`), and keeping compiled
programs across runs (`use_persistent_cache`).

The trainer logs each phase's compile seconds (``time/rollout_compile_s``,
``time/update_compile_s``): a step that meets new shapes (a new micro-batch length for
the gradient, a new decode bucket) spends them on top of its work, and benchmarks take
them out of throughput (a long run compiles each shape once). Tests use the count to
show that warm calls compile nothing.
"""

from __future__ import annotations

import os
import threading

import jax

from spec_rl_jax.checkpoint import cache_dir


def use_persistent_cache() -> str | None:
  """Keeps compiled XLA programs on disk, so a rerun or a ``--resume`` loads most of
  them instead of compiling. The directory is ``$SPEC_RL_JAX_XLA_CACHE``, else ``<model
  cache>/xla``; an empty ``$SPEC_RL_JAX_XLA_CACHE`` turns it off; a
  ``jax_compilation_cache_dir`` already set (``$JAX_COMPILATION_CACHE_DIR``) wins. Call
  before anything compiles. Returns the directory in use (``None``: off).
  """
  if jax.config.jax_compilation_cache_dir:
    return jax.config.jax_compilation_cache_dir
  directory = os.environ.get("SPEC_RL_JAX_XLA_CACHE", os.path.join(cache_dir(), "xla"))
  if directory:
    jax.config.update("jax_compilation_cache_dir", directory)
  return directory or None


class CompileCounter:
  """Counts the XLA executables the entering thread builds while the context is active
  (``count``: JAX times a persistent-cache load as a backend compile, so loads count too
  and "nothing compiled" holds with or without a cache), and the seconds spent on them
  (``seconds``: tracing to a jaxpr, lowering to MLIR and the backend compile or cache
  load). JAX compiles on the calling thread, so another thread's compiles (the rollout
  thread of async RL) are not counted."""

  _EVENT = "/jax/core/compile/backend_compile_duration"
  _TIMED = (_EVENT, "/jax/core/compile/jaxpr_trace_duration",
            "/jax/core/compile/jaxpr_to_mlir_module_duration")
  _active: list["CompileCounter"] = []
  _registered = False

  def __init__(self):
    self.count = 0
    self.seconds = 0.0
    self._thread = threading.get_ident()

  @classmethod
  def _listener(cls, event: str, duration: float, *_args, **_kw) -> None:
    thread = threading.get_ident()
    for c in list(cls._active):
      if c._thread != thread:
        continue
      if event == cls._EVENT:
        c.count += 1
      if event in cls._TIMED:
        c.seconds += duration

  def __enter__(self):
    if not CompileCounter._registered:
      jax.monitoring.register_event_duration_secs_listener(CompileCounter._listener)
      CompileCounter._registered = True
    self._thread = threading.get_ident()
    CompileCounter._active.append(self)
    return self

  def __exit__(self, *exc):
    CompileCounter._active.remove(self)
