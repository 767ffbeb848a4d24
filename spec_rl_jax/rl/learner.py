"""The GRPO-family learner: rollouts → padded batch → mini-batches → micro-batches.

One global batch (``B·G`` responses of one step) is split into ``num_minibatches``
mini-batches, one optimizer step each; a mini-batch is split into micro-batches whose
gradients are accumulated on device before the step. Loss weights come from the
aggregation over the whole mini-batch (losses.py), so accumulation is exact:
``∇L_mb = Σ_micro ∇ Σ_{i,t} w_{i,t} ℓ_{i,t}``. Micro-batches group responses of
similar length and drop the padding columns none of them use (`micro_batches`): the
update of a long-response step costs what its responses need, not ``T`` each.

Old-policy logprobs ``log π_old`` are the rollout's raw-policy ones
(``Response.policy_logprobs``: the target's verification logits, no temperature/top-k/
top-p; losses.py says why); the trainer's recomputed ``log π_θ`` on the first
mini-batch (same params) gives the rollout/trainer logprob gap, logged every step.

The state lives on the policy's mesh: parameters and Adam moments keep the policy's
shardings (`sharding.RULES`), micro-batch rows are split over ``data`` × ``fsdp``, and
the update runs under that mesh (the model's activation constraints apply).

A non-finite loss or gradient leaves the state unchanged (the step is skipped inside
the jitted update) and is reported as ``skipped``.

Shape legend: N responses, m responses per micro-batch, T time (prompt + response,
right-padded), T_b a micro-batch's trimmed time, V vocab.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from spec_rl_jax import sharding
from spec_rl_jax.config import LearnerConfig
from spec_rl_jax.models.attention import NoCache
from spec_rl_jax.models.layout import training_compiler_options
from spec_rl_jax.models.transformer import Decoder
from spec_rl_jax.rl import losses

# Per-micro-batch sums reduced into the step's metrics (``count`` = response tokens).
_SUMS = ("count", "clipped", "entropy", "kl", "gap_abs", "ratio")
_STATS = ("loss", *_SUMS)  # what the accumulator carries besides the gradients
BUCKETS = 8  # micro-batch lengths per T (`padded_len`)


def pack_rollouts(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                  old_logprobs: Sequence[np.ndarray], advantages: np.ndarray, T: int,
                  pad_id: int) -> dict[str, np.ndarray]:
  """Right-padded next-token arrays of prompt + response sequences.

  Returns ``tokens[N, T]`` inputs, ``targets[N, T]`` next tokens, ``valid[N, T]``,
  ``mask[N, T]`` (1 where the target is a response token), ``old_logp[N, T]`` (the
  rollout's ``log π_old`` of each target, 0 elsewhere) and ``adv[N]``.
  """
  N = len(prompts)
  out = {"tokens": np.full((N, T), pad_id, np.int32),
         "targets": np.full((N, T), pad_id, np.int32),
         "valid": np.zeros((N, T), bool), "mask": np.zeros((N, T), np.float32),
         "old_logp": np.zeros((N, T), np.float32),
         "adv": np.asarray(advantages, np.float32).reshape(N)}
  for i, (p, r, lp) in enumerate(zip(prompts, responses, old_logprobs)):
    seq = list(p) + list(r)
    if len(seq) - 1 > T:
      raise ValueError(f"sequence of {len(seq)} tokens does not fit T={T}")
    n, P = len(seq) - 1, len(p)
    out["tokens"][i, :n] = seq[:-1]
    out["targets"][i, :n] = seq[1:]
    out["valid"][i, :n] = True
    out["mask"][i, P - 1:n] = 1.0
    out["old_logp"][i, P - 1:n] = lp
  return out


def make_optimizer(cfg: LearnerConfig) -> optax.GradientTransformation:
  """AdamW behind global-norm clipping; linear warmup to a constant ``lr`` (update
  ``u`` = 0, 1, ... uses ``lr · min((u + 1) / warmup_steps, 1)``: the first one learns)."""
  warmup = max(cfg.warmup_steps, 1)
  schedule = lambda count: cfg.lr * jnp.minimum((count + 1) / warmup, 1.0)  # noqa: E731
  return optax.chain(optax.clip_by_global_norm(cfg.clip_norm),
                     optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2,
                                 weight_decay=cfg.weight_decay))


def _token_logps(graphdef, params, mb) -> tuple[jax.Array, jax.Array]:
  """``(log π(target) [m, T], entropy [m, T])`` of one micro-batch."""
  tokens = mb["tokens"]
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
  logits = nnx.merge(graphdef, params)(tokens, positions,
                                       cache=NoCache(valid=mb["valid"])).logits
  logp = jax.nn.log_softmax(logits)  # [m, T, V]
  target_logp = jnp.take_along_axis(logp, mb["targets"][..., None], -1)[..., 0]
  return target_logp, losses.entropy(logits)


def _micro_loss(params, graphdef, ref_params, mb, loss_name: str, p: losses.LossParams):
  """``Σ w ℓ`` over one micro-batch, plus the per-token sums for metrics."""
  logp, ent = _token_logps(graphdef, params, mb)
  per_token, clipped = losses.get_policy_loss(loss_name)(logp, mb["old_logp"], mb["adv"], p)
  m = mb["mask"]
  kl = jnp.zeros_like(logp)
  if ref_params is not None:
    ref_logp, _ = _token_logps(graphdef, ref_params, mb)
    kl = losses.kl_k3(logp, jax.lax.stop_gradient(ref_logp))
    per_token = per_token + p.kl_coef * kl
  sums = {"count": m.sum(), "clipped": (clipped * m).sum(),
          "entropy": (jax.lax.stop_gradient(ent) * m).sum(),
          "kl": (jax.lax.stop_gradient(kl) * m).sum(),
          "gap_abs": (jnp.abs(jax.lax.stop_gradient(logp) - mb["old_logp"]) * m).sum(),
          "ratio": (jnp.exp(jax.lax.stop_gradient(logp) - mb["old_logp"]) * m).sum()}
  return (per_token * mb["weight"]).sum(), sums


def accumulate_grads(acc, params, ref_params, micros, *, graphdef, loss_name: str,
                     loss_params: losses.LossParams):
  """``acc + Σ_micro (∇ Σ w ℓ, {_STATS})`` over micro-batches ``[n_g, m, T_b]``."""
  grad_fn = jax.value_and_grad(_micro_loss, has_aux=True)

  def body(acc, micro):
    (loss, sums), grads = grad_fn(params, graphdef, ref_params, micro, loss_name,
                                  loss_params)
    return jax.tree.map(jnp.add, acc, (grads, {"loss": loss, **sums})), None

  return jax.lax.scan(body, acc, micros)[0]


def apply_grads(state, grads, stats, *, tx):
  """One optimizer step on ``state = {"params", "opt"}`` from accumulated ``grads``.

  Returns ``(state, metrics)``; a non-finite loss or gradient norm keeps the old state
  (``metrics["skipped"] = 1``).
  """
  grad_norm = optax.tree.norm(grads)
  updates, opt = tx.update(grads, state["opt"], state["params"])
  new = {"params": optax.apply_updates(state["params"], updates), "opt": opt}
  ok = jnp.isfinite(stats["loss"]) & jnp.isfinite(grad_norm)
  new = jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, state)
  n = jnp.maximum(stats["count"], 1.0)
  metrics = {"loss": stats["loss"], "grad_norm": grad_norm,
             "skipped": 1 - ok.astype(jnp.int32),
             "clip_frac": stats["clipped"] / n, "entropy": stats["entropy"] / n,
             "kl": stats["kl"] / n, "logprob_gap": stats["gap_abs"] / n,
             "ratio_mean": stats["ratio"] / n}
  return new, metrics


class Learner:
  """Holds ``{"params", "opt"}`` of the policy (and a frozen reference when β > 0)."""

  def __init__(self, model: Decoder, cfg: LearnerConfig, max_response_len: int):
    self.cfg, self.max_response_len = cfg, max_response_len
    self.graphdef, params = nnx.split(model)
    params = nnx.to_pure_dict(params)
    self.tx = make_optimizer(cfg)
    leaf = jax.tree.leaves(params)[0]
    self.mesh = mesh = (leaf.sharding.mesh if isinstance(leaf.sharding, NamedSharding)
                        else sharding.make_mesh((1, 1, 1)))
    # Adam's moments are laid out like the parameters they track; counters replicated.
    opt_shardings = optax.tree_map_params(
        self.tx, lambda _, s: s, jax.eval_shape(self.tx.init, params),
        jax.tree.map(lambda x: x.sharding, params),
        transform_non_params=lambda _: NamedSharding(mesh, P()))
    self.state = {"params": params,
                  "opt": jax.jit(self.tx.init, out_shardings=opt_shardings)(params)}
    # β > 0: a frozen copy of the initial policy (a separate buffer: state is donated).
    self.ref_params = (jax.tree.map(jnp.copy, params) if cfg.kl_coef > 0 else None)
    self.loss_params = losses.LossParams(cfg.clip_eps_low, cfg.clip_eps_high, cfg.kl_coef)
    # The state keeps its shardings across steps (donated in place, one compile; the
    # engine's copy of the weights keeps its compiled programs too). Gradients are laid
    # out like the parameters; the per-micro-batch sums are replicated scalars.
    state_shardings = jax.tree.map(lambda x: x.sharding, self.state)
    replicated = NamedSharding(mesh, P())
    acc_shardings = (state_shardings["params"], {k: replicated for k in _STATS})
    self._zeros = jax.jit(
        lambda params: (jax.tree.map(jnp.zeros_like, params),
                        {k: jnp.float32(0) for k in _STATS}),
        out_shardings=acc_shardings)
    self._accumulate = jax.jit(
        functools.partial(accumulate_grads, graphdef=self.graphdef, loss_name=cfg.loss,
                          loss_params=self.loss_params),
        donate_argnums=0, out_shardings=acc_shardings,
        compiler_options=training_compiler_options())
    self._apply = jax.jit(functools.partial(apply_grads, tx=self.tx), donate_argnums=0,
                          out_shardings=(state_shardings, replicated),
                          compiler_options=training_compiler_options())

  def model(self) -> Decoder:
    """The current policy as a `Decoder` (shares the learner's buffers)."""
    return nnx.merge(self.graphdef, self.state["params"])

  def check_batch_size(self, N: int) -> None:
    """``N`` responses must split into mini-batches of whole micro-batches."""
    k, m = self.cfg.num_minibatches, self.cfg.micro_batch_size
    if N % k or (N // k) % m:
      raise ValueError(f"{N} responses per step (prompts_per_step x group_size) do not"
                       f" split into learner.num_minibatches={k} mini-batches of"
                       f" micro-batches of learner.micro_batch_size={m}")

  def minibatches(self, batch: dict[str, np.ndarray]) -> list[list[dict[str, np.ndarray]]]:
    """Splits ``N`` responses into mini-batches of `micro_batches`."""
    N = batch["adv"].shape[0]
    self.check_batch_size(N)
    out = []
    for part in np.split(np.arange(N), self.cfg.num_minibatches):
      mb = {key: v[part] for key, v in batch.items()}
      mb["weight"] = losses.aggregation_weights(self.cfg.aggregation, mb["mask"],
                                                self.max_response_len)
      out.append(micro_batches(mb, self.cfg.micro_batch_size))
    return out

  def _place(self, micros: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    """Micro-batches ``[n_g, m, ...]`` with their ``m`` rows split over the mesh's batch
    axes (``data`` × ``fsdp``, where ``m`` divides; else replicated)."""
    shape = dict(self.mesh.shape)
    return {k: jax.device_put(v, NamedSharding(self.mesh, sharding.logical_to_spec(
        (None, "batch", *(None,) * (v.ndim - 2)), v.shape, shape))) for k, v in micros.items()}

  def gradients(self, groups: list[dict[str, np.ndarray]]) -> tuple[Any, dict[str, jax.Array]]:
    """``(Σ ∇ Σ w ℓ, {_STATS})`` of one mini-batch's micro-batch groups, accumulated on
    device at the current parameters."""
    with jax.set_mesh(self.mesh):
      acc = self._zeros(self.state["params"])
      for group in groups:
        acc = self._accumulate(acc, self.state["params"], self.ref_params, self._place(group))
    return acc

  def update(self, batch: dict[str, np.ndarray]) -> dict[str, Any]:
    """One step on a packed global batch (`pack_rollouts`); returns its metrics.

    ``logprob_gap`` (mean |log π_θ - log π_old| over response tokens) is taken from the
    first mini-batch, whose forward still uses the rollout's parameters.
    ``positions_computed_frac``: the share of the batch's ``N × T`` positions the
    micro-batches' forward and backward passes compute (`micro_batches` trims padding).
    """
    metrics, computed = [], 0
    for groups in self.minibatches(batch):
      acc = self.gradients(groups)
      computed += sum(group["tokens"].size for group in groups)
      with jax.set_mesh(self.mesh):
        self.state, m = self._apply(self.state, *acc)
      metrics.append(jax.device_get(m))
    out = {k: float(np.mean([m[k] for m in metrics])) for k in metrics[0]}
    out["logprob_gap"] = float(metrics[0]["logprob_gap"])
    out["skipped"] = int(sum(m["skipped"] for m in metrics))
    out["positions_computed_frac"] = computed / batch["tokens"].size
    return out


def padded_len(n: int, T: int) -> int:
  """The length a micro-batch whose sequences need ``n`` positions is padded to.

  ``n`` rounded up to a multiple of ``ceil(T / BUCKETS)`` (itself a multiple of 64),
  at most ``T``: at most `BUCKETS` shapes, so at most that many compiles of the
  gradient (one for ``T <= 64``).
  """
  step = -(-T // BUCKETS)
  step = -(-step // 64) * 64
  return min(T, -(-max(n, 1) // step) * step)


def micro_batches(mb: dict[str, np.ndarray], m: int) -> list[dict[str, np.ndarray]]:
  """A mini-batch ``[k, T]`` as ``k / m`` micro-batches ``[m, T_b]``, trimmed to length,
  stacked into groups ``[n_g, m, T_b]`` (one scanned call each).

  Rows are ordered by length (longest first, ties in row order), so each micro-batch
  holds responses of similar lengths and computes ``T_b = padded_len(longest)`` positions
  instead of ``T``: attention costs ``T_b²``, and in long-response RL the lengths of one
  step's responses spread over thousands of tokens. The trimmed positions are padding
  (no loss weight), so the accumulated gradient is the untrimmed one.

  Groups: all ``k / m`` micro-batches in one when they share one width (short responses:
  one scanned call is faster than one call each), else one each. So a run compiles at
  most 2 x `BUCKETS` gradient shapes and meets them early (power-of-two groups of every
  run of equal widths would give up to 3 x `BUCKETS`, met over many more steps:
  docs/benchmarks.md, learner micro-batch grouping).
  """
  lengths = mb["valid"].sum(axis=1)
  order = np.argsort(-lengths, kind="stable")
  T = mb["tokens"].shape[1]
  rows = np.split(order, len(order) // m)
  widths = [padded_len(int(lengths[r].max()), T) for r in rows]
  if len(set(widths)) == 1:
    groups = [(np.stack(rows), widths[0])]  # [n_g, m]
  else:
    groups = [(r[None], w) for r, w in zip(rows, widths)]
  return [{k: v[idx, :w] if v.ndim == 2 else v[idx] for k, v in mb.items()}
          for idx, w in groups]
