"""How rollouts and updates interleave: sync (staleness 0) and async (bounded staleness).

The trainer's loop is one for both modes: step t takes its rollouts (`Pipeline.get`),
updates the policy, hands the new weights, version t + 1, to the pipeline (`publish`),
and at a barrier (an evaluation or a checkpoint) uses the engine and the data stream
itself (`exclusive`). The pipeline decides where and when rollouts are generated:

  sync   step t's rollouts are generated inline, by version t (the weights after t
         updates), once step t - 1's update is done;
  async  a host thread generates them ahead, by version ``v(t)`` (`Schedule.version`),
         while the learner's thread updates: the rollouts of step t + 1 overlap the
         update of step t. The rollout thread owns the engine, the proposer's host
         memory and the data stream between barriers; weights reach it as copies on
         the engine's mesh (the learner donates its buffers to its next update) and it
         installs them with ``RolloutEngine.set_weights(..., version)``, which records
         every token's version.

Placement (``rollout.mesh``), the same code for both: (a) the engine on the learner's
mesh, the two threads' programs interleaving on the same devices through JAX's
asynchronous dispatch; (b) the engine on a disjoint sub-mesh, the published weights
copied across (device to device) after each update.

Staleness. Step t trains at version t on rollouts of version ``v(t)``, a function of
the config alone::

    v(t) = max(t - N, b(t)),   b(t) = the last barrier (or the run's first step) <= t

with N = ``rl.max_staleness``. So no token trained on is more than N versions behind the
learner, whatever the timing (the trainer checks it on every batch), and a run's future
is a function of its config: async with N = 0 is the sync run, bit for bit, and N >= 1
gives the same parameters whether rollouts or updates run slow. The price of the fixed
lag: a rollout never samples from weights fresher than ``v(t)`` even when they exist.

Barriers and resume. At a barrier s the rollout thread waits for version s and does not
touch the engine or the data stream until the learner has evaluated and checkpointed
with them (`exclusive`): a checkpoint at step s holds the data iterator and the n-gram
memory after batch s - 1 and nothing in flight. In-flight rollouts are thus never
checkpointed: a resumed run regenerates them, deterministically, from the checkpoint's
version s (``b(s) = s``), exactly as the uninterrupted run generated them. The cost is
one step without overlap per barrier.

Timing. The pipeline keeps every rollout's wall-clock interval (``rollouts``; the
trainer adds its updates' to ``updates``: the run's timeline). `timing` gives, over a
step's window, the fraction of it the rollout side was busy (generating and scoring)
and the fraction the learner waited for rollouts, in both modes (sync: the rollout
time, the learner idle meanwhile).
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
from flax import nnx

from spec_rl_jax import sharding
from spec_rl_jax.models.transformer import Decoder
from spec_rl_jax.rollout.engine import RolloutEngine


class RolloutThreadError(RuntimeError):
  """The rollout thread raised; the original exception is the ``__cause__``."""


@dataclasses.dataclass(frozen=True)
class Schedule:
  """Which weights version samples each step's rollouts (module docstring: ``v(t)``).

  ``start``: the run's first step (0, or the step it resumed from), ``stop``: the step
  count it trains to, ``barrier(s)``: whether the learner evaluates or checkpoints after
  s updates, before step s's rollouts.
  """

  start: int
  stop: int
  max_staleness: int
  barrier: Callable[[int], bool]

  def version(self, t: int) -> int:
    for u in range(t, max(t - self.max_staleness, self.start) - 1, -1):
      if u == self.start or self.barrier(u):
        return u
    return t - self.max_staleness


@dataclasses.dataclass
class Rollouts:
  """One step's rollouts, scored and packed for the learner (`Trainer.rollout`)."""

  step: int
  batch: dict[str, Any]  # `learner.pack_rollouts`, padded to the step's responses
  metrics: dict[str, Any]  # rollout/*, spec/*, time/rollout_* metrics of the step
  long_prompts_skipped: int = 0


def _copy(model: Decoder | None, mesh: jax.sharding.Mesh) -> Decoder | None:
  """``model`` on buffers of its own on ``mesh`` (the engine's: the learner's own, or
  a disjoint one), dispatched asynchronously."""
  if model is None:
    return None
  graphdef, state = nnx.split(model)
  return nnx.merge(graphdef, sharding.copy_state(state, mesh))


class Pipeline:
  """Sync: rollouts generated inline, weights installed as soon as published.

  ``rollout(t)`` generates, scores and packs step t's rollouts with the engine's
  current weights; the pipeline has installed version ``schedule.version(t)`` first.
  """

  def __init__(self, engine: RolloutEngine, rollout: Callable[[int], Rollouts],
               schedule: Schedule):
    self.engine, self.schedule, self._rollout = engine, schedule, rollout
    # [step, start, end] (perf_counter seconds; end inf while running)
    self.rollouts: list[list[float]] = []
    self.updates: list[list[float]] = []
    self._waited = 0.0  # seconds the learner waited in `get` since the last `timing`

  def _generate(self, t: int) -> Rollouts:
    if self.engine.version != self.schedule.version(t):
      raise AssertionError(f"step {t}'s rollouts need weights version"
                           f" {self.schedule.version(t)}; the engine holds"
                           f" {self.engine.version}")
    interval = [t, time.perf_counter(), float("inf")]
    self.rollouts.append(interval)
    out = self._rollout(t)
    interval[2] = time.perf_counter()
    return out

  def get(self, t: int) -> Rollouts:
    """Step t's rollouts."""
    start = time.perf_counter()
    out = self._generate(t)
    self._waited += time.perf_counter() - start
    return out

  def publish(self, version: int, policy: Decoder, drafter: Decoder | None) -> None:
    """The learner's weights after ``version`` updates (``drafter``: the drafter when
    this update trained it, else None)."""
    self.engine.set_weights(policy, drafter, version=version)

  @contextlib.contextmanager
  def exclusive(self, version: int) -> Iterator[None]:
    """The engine (holding weights ``version``) and the data stream are the caller's."""
    yield

  def timing(self, window: tuple[float, float]) -> dict[str, float]:
    """Over the wall-clock ``window`` of a step: the rollout side's busy fraction and
    the learner's idle fraction (waiting in `get`)."""
    lo, hi = window
    span = max(hi - lo, 1e-9)
    busy = 0.0
    for _, s, e in reversed(list(self.rollouts)):  # a copy: the rollout side appends
      if e < lo:
        break
      busy += max(0.0, min(e, hi) - max(s, lo))
    waited, self._waited = self._waited, 0.0
    return {"time/rollout_busy_frac": min(busy / span, 1.0),
            "time/rollout_idle_frac": max(1.0 - busy / span, 0.0),
            "time/learner_idle_frac": min(waited / span, 1.0),
            "time/learner_busy_frac": max(1.0 - waited / span, 0.0)}

  def close(self) -> None:
    pass


class AsyncPipeline(Pipeline):
  """Async: a host thread generates step t's rollouts by version ``v(t)`` ahead of the
  learner (module docstring)."""

  def __init__(self, engine: RolloutEngine, rollout: Callable[[int], Rollouts],
               schedule: Schedule):
    super().__init__(engine, rollout, schedule)
    self._cv = threading.Condition()
    self._weights: dict[int, tuple[Decoder, Decoder | None]] = {}  # published, not taken
    self._released = schedule.start  # the newest version the rollout thread may use
    self._stop = False
    self._engine_lock = threading.Lock()  # the engine and the data stream: one user
    self._out: queue.Queue = queue.Queue()
    self._thread = threading.Thread(target=self._produce, name="rollouts", daemon=True)

  def _take(self, version: int) -> None:
    """Installs weights ``version`` in the engine (with the newest drafter published
    since the last install), dropping older copies."""
    if self.engine.version == version:
      return
    with self._cv:
      taken = sorted(v for v in self._weights if v <= version)
      entries = [self._weights.pop(v) for v in taken]
    if not taken or taken[-1] != version:
      raise AssertionError(f"weights version {version} was never published")
    drafters = [d for _, d in entries if d is not None]
    self.engine.set_weights(entries[-1][0], drafters[-1] if drafters else None,
                            version=version)

  def _produce(self) -> None:
    try:
      for t in range(self.schedule.start, self.schedule.stop):
        v = self.schedule.version(t)
        with self._cv:
          self._cv.wait_for(lambda: self._stop or self._released >= v)
          if self._stop:
            return
        with self._engine_lock:
          self._take(v)
          out = self._generate(t)
        self._out.put(out)
    except BaseException as e:  # noqa: BLE001  handed to the learner's thread
      self._out.put(e)

  def get(self, t: int) -> Rollouts:
    """Step t's rollouts, from the rollout thread (started by the first call); the
    learner, asking for them, is done with every version up to t."""
    with self._cv:
      self._released = max(self._released, t)
      self._cv.notify_all()
    if not self.schedule.start <= t < self.schedule.stop:
      raise ValueError(f"step {t} is outside the run's steps [{self.schedule.start},"
                       f" {self.schedule.stop})")
    if self._thread.ident is None:
      self._thread.start()
    start = time.perf_counter()
    out = None
    while out is None:
      try:
        out = self._out.get(timeout=1.0)
      except queue.Empty:
        if not self._thread.is_alive() and self._out.empty():
          raise RolloutThreadError(f"the rollout thread ended without step {t}'s"
                                   " rollouts") from None
    self._waited += time.perf_counter() - start
    if isinstance(out, BaseException):
      raise RolloutThreadError(f"the rollout thread failed while generating step {t}'s"
                               f" rollouts (or earlier): {out!r}") from out
    if out.step != t:
      raise AssertionError(f"the learner is at step {t}; the rollouts are step {out.step}'s")
    return out

  def publish(self, version: int, policy: Decoder, drafter: Decoder | None) -> None:
    with self._cv:
      mesh = self.engine.mesh
      self._weights[version] = (_copy(policy, mesh), _copy(drafter, mesh))
      if not self.schedule.barrier(version):
        self._released = version
        self._cv.notify_all()

  @contextlib.contextmanager
  def exclusive(self, version: int) -> Iterator[None]:
    """At a barrier the rollout thread waits for ``version`` until the block ends."""
    with self._engine_lock:
      self._take(version)
      yield
    with self._cv:
      self._released = max(self._released, version)
      self._cv.notify_all()

  def close(self, timeout: float = 600.0) -> None:
    """Stops the rollout thread after its current rollout (if any)."""
    with self._cv:
      self._stop = True
      self._cv.notify_all()
    if self._thread.is_alive():
      self._thread.join(timeout)


PIPELINES: dict[str, type[Pipeline]] = {"sync": Pipeline, "async": AsyncPipeline}
