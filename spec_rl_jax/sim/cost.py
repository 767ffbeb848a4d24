"""Cost of one forward call, of the learner's update, of moving weights, and the memory
each chip needs: rooflines over the shapes of `models.SimModel` and the rates of
`hardware.Chip` (symbols in both module docstrings).

A rollout replica is ``t`` chips in tensor parallel (``t`` = TP; for a MoE model the
experts are spread over the same ``t`` chips, expert-parallel); the pod runs
``chips / t`` replicas side by side. The learner shards its state over all its chips
(FSDP).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from spec_rl_jax.sim.hardware import HBM_USABLE, Pod
from spec_rl_jax.sim.models import SimModel

TRAIN_STATE_BYTES = 16  # per parameter: fp32 master weights, gradients, Adam m and v
OPTIMIZER_TRAFFIC_BYTES = 28  # per parameter: Adam reads params, grads, m, v; writes 3
COLLECTIVE_LATENCY = 10e-6  # α: one collective's fixed cost (assumed, all accelerators)


@dataclasses.dataclass(frozen=True)
class Mesh:
  """``tp`` chips per rollout replica (tensor / expert parallel), ``dp`` replicas."""

  tp: int
  dp: int

  @property
  def chips(self) -> int:
    return self.tp * self.dp


def check_mesh(model: SimModel, mesh: Mesh) -> None:
  """TP must divide the query heads (and the experts of a MoE model), and divide or be a
  multiple of the KV heads (more TP chips than KV heads replicate them)."""
  t = mesh.tp
  problems = []
  if model.heads % t:
    problems.append(f"{model.heads} query heads are not divisible by tp={t}")
  if model.moe and model.experts % t:
    problems.append(f"{model.experts} experts are not divisible by tp={t}")
  if model.kv_heads % t and t % model.kv_heads:
    problems.append(f"{model.kv_heads} KV heads neither divide nor are divisible by tp={t}")
  if problems:
    raise ValueError(f"mesh tp={t} x dp={mesh.dp} does not divide {model.name}: "
                     + "; ".join(problems))


def kv_shards(model: SimModel, tp: int) -> int:
  """Chips a token's KV is split over: ``min(t, H_kv)`` (beyond that it is replicated)."""
  return min(tp, model.kv_heads)


def weight_bytes_read(model: SimModel, tokens):
  """Weight bytes one forward over ``n = tokens`` tokens reads (whole replica):
  ``b_w·(N_dense + L·E·(1 − (1 − a/E)^n)·N_expert)``: a MoE layer reads only the experts
  some token routes to (uniform routing: the expected number of distinct experts)."""
  if not model.moe:
    return np.full(np.shape(tokens), float(model.weight_bytes * model.total_params))
  touched = model.experts * (1 - (1 - model.active_experts / model.experts)
                             ** np.asarray(tokens, float))
  return model.weight_bytes * (model.dense_params
                               + model.layers * touched * model.expert_params)


@dataclasses.dataclass(frozen=True)
class CallCost:
  """Seconds of one forward call: ``compute`` and ``memory`` (the roofline takes the
  larger), ``comm`` (TP collectives), ``latency`` (τ + λ·L); ``total``."""

  compute: np.ndarray
  memory: np.ndarray
  comm: np.ndarray
  latency: float

  @property
  def total(self):
    return np.maximum(self.compute, self.memory) + self.comm + self.latency


def forward_cost(model: SimModel, pod: Pod, tp: int, tokens, kv_tokens, query_ctx) -> CallCost:
  """One forward of ``n = tokens`` new tokens on a ``t = tp``-chip replica, reading the
  KV of ``C = kv_tokens`` cached tokens, ``Q = query_ctx`` = Σ over new tokens of the
  positions each attends to (arrays broadcast: one entry per round).

    FLOPs   = 2·N_active·n + 4·L·H·h·Q
    bytes   = weight_bytes_read(n)/t + KV_tok·(C + n)/min(t, H_kv)
    compute = FLOPs / (t·P·η_P)
    memory  = bytes / (W·η_W)
    comm    = (t > 1) per layer: dense: 2 all-reduces of n·d·2 bytes,
              2(t−1)/t·n·d·2/β + α each; MoE: the attention all-reduce plus an
              all-to-all dispatch and combine of n·a·d·2 bytes, (t−1)/t·n·a·d·2/(t·β) + α
              each
    latency = τ + λ·L   (fixed cost of the call and of each of its L layers)
    total   = max(compute, memory) + comm + latency
  """
  c = pod.chip
  n = np.asarray(tokens, float)
  flops = (2 * model.active_params * n
           + 4 * model.layers * model.heads * model.head_dim * np.asarray(query_ctx, float))
  kv = model.kv_bytes_per_token * (np.asarray(kv_tokens, float) + n) / kv_shards(model, tp)
  mem = weight_bytes_read(model, n) / tp + kv
  comm = np.zeros_like(n)
  if tp > 1:
    beta = pod.collective_bw(tp)
    act = n * model.d_model * 2
    allreduce = 2 * (tp - 1) / tp * act / beta + COLLECTIVE_LATENCY
    if model.moe:
      a2a = (tp - 1) / tp * act * model.active_experts / tp / beta + COLLECTIVE_LATENCY
      comm = model.layers * (allreduce + 2 * a2a)
    else:
      comm = model.layers * 2 * allreduce
  return CallCost(flops / (tp * c.peak_flops * c.flops_eff), mem / (c.hbm_bw * c.bw_eff),
                  comm, c.call_latency + c.layer_latency * model.layers)


def learner_flops(model: SimModel, seq_lens, extra_forwards: int = 0) -> float:
  """Model FLOPs of one forward + backward over sequences of lengths ``T_i`` (prompt +
  response, as computed: padding included), ``tokens = Σ T_i``, plus ``f =
  extra_forwards`` forwards (a log-prob recompute, a frozen reference's KL):

    FLOPs = (6 + 2·f)·(N_active·tokens + L·H·h·Σ T_i²)
            (the attention term: causal QKᵀ and PV, forward 2·, backward 4·)
  """
  T = np.asarray(seq_lens, float)
  return float((6 + 2 * extra_forwards) * (model.active_params * T.sum()
                                           + model.layers * model.heads * model.head_dim
                                           * float(np.sum(T * T))))


def learner_time(model: SimModel, pod: Pod, chips: int, seq_lens: np.ndarray, mfu: float,
                 extra_forwards: int = 0) -> dict[str, float]:
  """The update on ``c = chips`` chips for sequences of lengths ``T_i`` (prompt +
  response), ``tokens = Σ T_i``:

    FLOPs   = `learner_flops` = (6 + 2·f)·(N_active·tokens + L·H·h·Σ T_i²)
              (f = extra_forwards: e.g. a log-prob recompute)
    compute = FLOPs / (MFU·P·c)   (this machine, calibration (a): MFU·P is the learner's
              rate probed alongside the run, `overhead.LearnerProbe`)
    comm    = FSDP: gather bf16 params for forward and backward, reduce-scatter fp32
              gradients: 8·N_total·(c − 1)/c / β (overlapped with compute: the max counts)
    optimizer = 28·N_total / (c·W·η_W)   (Adam's reads and writes)
  Returns the parts and ``total = max(compute, comm) + optimizer``.
  """
  c = pod.chip
  flops = learner_flops(model, seq_lens, extra_forwards)
  compute = flops / (mfu * c.peak_flops * chips)
  comm = (8 * model.total_params * (chips - 1) / chips / pod.collective_bw(chips)
          if chips > 1 else 0.0)
  opt = OPTIMIZER_TRAFFIC_BYTES * model.total_params / (chips * c.hbm_bw * c.bw_eff)
  return {"compute": compute, "comm": comm, "optimizer": opt,
          "total": max(compute, comm) + opt}


def transfer_time(model: SimModel, pod: Pod, tp: int, chips: int, colocated: bool) -> float:
  """Installing new weights in the rollout replicas. Each rollout chip receives its
  shard ``S = b_w·N_total/t``:

    colocated (sync, one pool): resharding inside the pod, S/β over ``chips`` chips
              (one chip: a copy in HBM, 2·S/(W·η_W));
    disjoint pools (async):     S/β_net, sent from the learner's chips to another pool.
  """
  shard = model.weight_bytes * model.total_params / tp
  if colocated and chips == 1:
    return 2 * shard / (pod.chip.hbm_bw * pod.chip.bw_eff)
  return shard / (pod.collective_bw(chips) if colocated else pod.chip.net_bw)


@dataclasses.dataclass(frozen=True)
class ChipMemory:
  """Bytes per chip: inference ``params`` (policy and drafter), ``optimizer`` (the
  learner's state), ``kv`` (KV pools of policy and drafter); ``usable`` = M·`HBM_USABLE`."""

  params: float
  optimizer: float
  kv: float
  usable: float

  @property
  def total(self) -> float:
    return self.params + self.optimizer + self.kv


def chip_memory(pod: Pod, tp: int, model: SimModel, drafter: SimModel | None, slots: int,
                max_len: int, learner_chips: int) -> ChipMemory:
  """``params = b_w·(N_total + N_draft)/t``; ``optimizer = 16·N_total/c_learner`` (zero
  on a pool without the learner: ``learner_chips = 0``); ``kv = S·L_max·(KV_tok +
  KV_tok,draft)/min(t, H_kv)`` for ``S`` slots of ``L_max`` positions. Activations are
  left out: micro-batches are sized to the room that is left."""
  params = model.weight_bytes * model.total_params
  kv_tok = model.kv_bytes_per_token
  if drafter is not None:
    params += drafter.weight_bytes * drafter.total_params
    kv_tok += drafter.kv_bytes_per_token
  opt = TRAIN_STATE_BYTES * model.total_params / learner_chips if learner_chips else 0.0
  return ChipMemory(params / tp, opt, slots * max_len * kv_tok / kv_shards(model, tp),
                    pod.chip.hbm_bytes * HBM_USABLE)


def check_memory(mem: ChipMemory, what: str) -> None:
  """Raises when ``mem`` does not fit, saying by how much per chip and where it goes."""
  if mem.total <= mem.usable:
    return
  gb = lambda x: f"{x / 1e9:.1f} GB"
  raise ValueError(
      f"{what} does not fit: per chip params {gb(mem.params)} + optimizer"
      f" {gb(mem.optimizer)} + KV pools {gb(mem.kv)} = {gb(mem.total)} > usable"
      f" {gb(mem.usable)} (short by {gb(mem.total - mem.usable)} per chip); use more"
      " chips, a larger tp, or fewer slots / shorter max length")
