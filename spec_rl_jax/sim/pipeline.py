"""One RL step, synchronous or asynchronous: rollout, reward, update, weight transfer.

Step ``i`` has rollout time ``R_i`` (`rollout.simulate_rollout`, its own draw of
response lengths), reward time ``G`` (host, given), update ``U_i``
(`cost.learner_time`) and transfer ``X`` (`cost.transfer_time`). With staleness bound
``s`` (rollout ``i`` may use weights up to ``s`` versions old):

  rollout start  a_i = max(b_{i−1}, w_{i−1−s})   (its pool is free; weights new enough)
  rollout end    b_i = a_i + R_i
  update end     u_i = max(u_{i−1}, b_i) + G + U_i
  weights ready  w_i = u_i + X

* sync: one pool of all chips, ``s = 0`` and the rollout also waits for the update
  (``a_i >= w_{i−1}``), so a step is ``R_i + G + U_i + X`` exactly.
* async: disjoint pools, ``rollout_chips`` for the rollout and the rest for the
  learner; the pipeline overlaps them up to ``s``. Larger ``s`` only relaxes a max, so it
  is never slower.

Step time and parts = means over the steps after the first ``s + 1`` (the pipeline
filling) of ``u_i − u_{i−1}`` (sync: ``w_i − w_{i−1}``). Idle: the pool's step time
less its busy time.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from spec_rl_jax.sim import cost
from spec_rl_jax.sim.hardware import HBM_USABLE, Pod
from spec_rl_jax.sim.models import Drafter, SimModel
from spec_rl_jax.sim.rollout import RolloutSetup, simulate_rollout

MAX_SLOTS = 256  # most sequences one replica decodes at once (vLLM's max_num_seqs default)


@dataclasses.dataclass(frozen=True)
class Workload:
  """Per step ``prompts x group`` responses; ``prompt_len`` tokens per prompt; lengths
  from ``lengths`` (recorded, cycled per step) or lognormal with mean ``mean_len``,
  shape ``len_sigma``, clipped to ``max_len``; the learner at ``mfu`` with
  ``extra_forwards`` more forward passes (a log-prob recompute: 1) and micro-batches of
  ``micro_batch`` sequences padded as the learner pads them (`padded_lengths`; 0:
  packed, no padding); ``reward_s``
  host seconds per step; ``steps`` simulated steps."""

  prompts: int
  group: int
  prompt_len: int
  mean_len: float
  max_len: int
  len_sigma: float = 0.8
  lengths: tuple | None = None
  mfu: float = 0.4
  extra_forwards: int = 0
  micro_batch: int = 0
  reward_s: float = 0.0
  steps: int = 4
  seed: int = 0

  @property
  def requests(self) -> int:
    return self.prompts * self.group


def sample_lengths(w: Workload, step: int) -> np.ndarray:
  """Response lengths of step ``step``: recorded (cycled), else lognormal with shape σ,
  scaled so the mean after clipping to ``[1, max_len]`` is ``mean_len``."""
  if w.lengths is not None:
    rec = np.asarray(w.lengths[step % len(w.lengths)], float)
    return np.resize(rec, w.requests)
  z = np.random.default_rng((w.seed, step)).lognormal(0.0, w.len_sigma, w.requests)
  scale = w.mean_len / z.mean()
  for _ in range(20):  # the clipped mean falls short of the target: raise the scale
    scale *= w.mean_len / np.clip(z * scale, 1, w.max_len).mean()
  return np.round(np.clip(z * scale, 1, w.max_len))


LEARNER_BUCKETS = 8  # `rl.learner.BUCKETS`: micro-batch widths per maximum length


def learner_width(n: int, T: int) -> int:
  """The width the learner pads a micro-batch needing ``n`` positions to
  (`rl.learner.padded_len`): ``n`` rounded up to a multiple of ``ceil(T / 8)`` (itself
  rounded up to a multiple of 64), at most ``T``."""
  step = -(-T // LEARNER_BUCKETS)
  step = -(-step // 64) * 64
  return min(T, -(-max(int(n), 1) // step) * step)


def padded_lengths(T: np.ndarray, micro_batch: int, max_T: int | None = None) -> np.ndarray:
  """Sequence lengths as the learner computes them (`rl.learner.micro_batches`):
  sequences ordered by length, longest first, in micro-batches of ``micro_batch``, each
  padded to its longest, rounded up to the learner's width bucket (`learner_width`) when
  ``max_T`` (prompt + maximum response) is given; 0: as they are (packed)."""
  if not micro_batch:
    return T
  T = np.sort(np.asarray(T, float))[::-1]
  out = []
  for i in range(0, len(T), micro_batch):
    part = T[i:i + micro_batch]
    width = learner_width(part.max(), max_T) if max_T else part.max()
    out.append(np.full(len(part), float(width)))
  return np.concatenate(out)


@dataclasses.dataclass(frozen=True)
class Plan:
  """Where things run: rollout replicas of ``tp`` chips on ``rollout_chips`` chips with
  ``slots`` each; the learner on ``learner_chips`` (sync: the same chips)."""

  tp: int
  rollout_chips: int
  learner_chips: int
  slots: int
  colocated: bool

  @property
  def replicas(self) -> int:
    return self.rollout_chips // self.tp


def fit_slots(pod: Pod, plan_tp: int, model: SimModel, drafter: Drafter, w: Workload,
              learner_chips: int, replicas: int, what: str) -> int:
  """The most slots per replica that fit next to the weights (and, colocated, the
  learner's state), capped at `MAX_SLOTS` and at the requests a replica gets; an error
  saying what does not fit when not even one slot does."""
  per_replica = -(-w.requests // replicas)
  max_len = w.prompt_len + w.max_len
  one = cost.chip_memory(pod, plan_tp, model, drafter.model, 1, max_len, learner_chips)
  cost.check_memory(one, what)
  room = one.usable - one.params - one.optimizer
  return int(max(1, min(MAX_SLOTS, per_replica, room // one.kv)))


def make_plan(pod: Pod, model: SimModel, drafter: Drafter, w: Workload, tp: int,
              rollout_chips: int | None, slots: int | None) -> Plan:
  """A `Plan` (sync when ``rollout_chips`` is None), checked for divisibility and
  memory."""
  colocated = rollout_chips is None
  rc = pod.chips if colocated else rollout_chips
  lc = pod.chips if colocated else pod.chips - rc
  if rc % tp or rc < tp:
    raise ValueError(f"mesh tp={tp} does not divide the {rc} rollout chips of {pod.name}")
  if not colocated and lc < 1:
    raise ValueError(f"async needs chips left for the learner: {rc} of {pod.chips} roll out")
  cost.check_mesh(model, cost.Mesh(tp, rc // tp))
  where = (f"{model.name} on {pod.name} (tp={tp}, {'sync, colocated' if colocated else f'async, {rc} rollout chips'})")
  if not colocated:
    learner = cost.ChipMemory(0.0, cost.TRAIN_STATE_BYTES * model.total_params / lc, 0.0,
                              pod.chip.hbm_bytes * HBM_USABLE)
    cost.check_memory(learner, f"the learner of {model.name} on {lc} chips of {pod.name}")
  fitted = fit_slots(pod, tp, model, drafter, w, lc if colocated else 0, rc // tp, where)
  if slots is not None:
    cost.check_memory(cost.chip_memory(pod, tp, model, drafter.model, slots,
                                       w.prompt_len + w.max_len, lc if colocated else 0),
                      where + f" with {slots} slots")
  return Plan(tp, rc, lc, slots or fitted, colocated)


@dataclasses.dataclass(frozen=True)
class StepResult:
  """Mean seconds per step by part: rollout pool (``prefill``, ``verify``, ``draft``,
  ``rollout`` = their sum, ``rollout_idle``), learner side (``reward``, ``learner``,
  ``transfer``, ``learner_idle``), ``step``; ``tail`` (rollout seconds with the queue
  empty), ``rounds_at_k``, and the per-step times."""

  step: float
  rollout: float
  prefill: float
  verify: float
  draft: float
  rollout_idle: float
  reward: float
  learner: float
  transfer: float
  learner_idle: float
  tail: float
  rounds_at_k: dict
  step_times: tuple


def simulate_steps(pod: Pod, model: SimModel, drafter: Drafter, a: np.ndarray,
                   k: int | None, w: Workload, plan: Plan, staleness: int) -> StepResult:
  """``w.steps`` steps of the recurrence in the module docstring."""
  setup = RolloutSetup(model, drafter, pod, plan.tp, plan.replicas, plan.slots, a, k)
  prompts = np.full(w.requests, float(w.prompt_len))
  X = cost.transfer_time(model, pod, plan.tp, plan.rollout_chips, plan.colocated)
  s = 0 if plan.colocated else staleness
  b = u = 0.0
  w_ready = [0.0]  # w_{−1}: the initial weights
  parts = {p: [] for p in ("prefill", "verify", "draft", "tail", "rollout", "learner")}
  ends, at_k = [], {}
  for i in range(w.steps):
    lengths = sample_lengths(w, i)
    r = simulate_rollout(setup, lengths, prompts)
    T = padded_lengths(lengths + w.prompt_len, w.micro_batch, w.prompt_len + w.max_len)
    U = cost.learner_time(model, pod, plan.learner_chips, T, w.mfu, w.extra_forwards)["total"]
    start = max(b, w_ready[max(0, len(w_ready) - 1 - s)])
    if plan.colocated:
      start = max(start, w_ready[-1])
    b = start + r.time
    u = max(u, b) + w.reward_s + U
    w_ready.append(u + X)
    ends.append(u if not plan.colocated else u + X)
    for p, v in (("prefill", r.prefill), ("verify", r.verify), ("draft", r.draft),
                 ("tail", r.tail), ("rollout", r.time), ("learner", U)):
      parts[p].append(v)
    for kk, n in r.rounds_at_k.items():
      at_k[kk] = at_k.get(kk, 0) + n
  warm = min(s + 1, w.steps - 1)
  times = np.diff([0.0, *ends])
  step = float(np.mean(times[warm:]))
  mean = {p: float(np.mean(v[warm:])) for p, v in parts.items()}
  busy_learner = w.reward_s + mean["learner"] + X
  return StepResult(
      step=step, rollout=mean["rollout"], prefill=mean["prefill"], verify=mean["verify"],
      draft=mean["draft"], rollout_idle=0.0 if plan.colocated else max(0.0, step - mean["rollout"]),
      reward=w.reward_s, learner=mean["learner"], transfer=X,
      learner_idle=0.0 if plan.colocated else max(0.0, step - busy_learner),
      tail=mean["tail"], rounds_at_k=at_k, step_times=tuple(float(t) for t in times))
