"""`CompileCounter`: the XLA compiles a block of code runs, and the seconds they take.

The trainer logs each phase's compile seconds (``time/rollout_compile_s``,
``time/update_compile_s``): a step that meets new shapes (a new micro-batch length for
the gradient, a new decode bucket) spends them on top of its work, and benchmarks take
them out of throughput (../shared/BENCHMARKS.md). Tests use the count to show that
warm calls compile nothing.
"""

from __future__ import annotations

import jax


class CompileCounter:
  """Counts XLA backend compiles while the context is active (``count``), and the
  seconds spent compiling (``seconds``: tracing to a jaxpr, lowering to MLIR and the
  backend compile, so persistent-cache hits count their tracing and lowering too)."""

  _EVENT = "/jax/core/compile/backend_compile_duration"
  _TIMED = (_EVENT, "/jax/core/compile/jaxpr_trace_duration",
            "/jax/core/compile/jaxpr_to_mlir_module_duration")
  _active: list["CompileCounter"] = []
  _registered = False

  def __init__(self):
    self.count = 0
    self.seconds = 0.0

  @classmethod
  def _listener(cls, event: str, duration: float, *_args, **_kw) -> None:
    for c in cls._active:
      if event == cls._EVENT:
        c.count += 1
      if event in cls._TIMED:
        c.seconds += duration

  def __enter__(self):
    if not CompileCounter._registered:
      jax.monitoring.register_event_duration_secs_listener(CompileCounter._listener)
      CompileCounter._registered = True
    CompileCounter._active.append(self)
    return self

  def __exit__(self, *exc):
    CompileCounter._active.remove(self)
