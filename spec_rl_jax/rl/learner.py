"""The GRPO-family learner: rollouts → padded batch → mini-batches → micro-batches.

One global batch (``B·G`` responses of one step) is split into ``num_minibatches``
mini-batches, one optimizer step each; a mini-batch is split into micro-batches whose
gradients are accumulated on device before the step. Loss weights come from the
aggregation over the whole mini-batch (losses.py), so accumulation is exact:
``∇L_mb = Σ_micro ∇ Σ_{i,t} w_{i,t} ℓ_{i,t}``. Micro-batches group responses of
similar length and drop the padding columns none of them use (`micro_batches`): the
update of a long-response step costs what its responses need, not ``T`` each. Where
the backend runs long forwards slower per position (XLA:CPU: activations leave the
caches), a micro-batch's forward + backward runs in scanned chunks of rows
(`chunk_rows`; same gradient, summed in another order).

Old-policy logprobs ``log π_old`` are the rollout's raw-policy ones
(``Response.policy_logprobs``: the target's verification logits, no temperature/top-k/
top-p; losses.py says why); the trainer's recomputed ``log π_θ`` on the first
mini-batch (same params) gives the rollout/trainer logprob gap, logged every step.
A loss that takes the proximal policy (``decoupled_ppo``, for asynchronous RL) also gets
``log π_prox``: the learner's parameters at the start of the update, recomputed for the
tokens an older policy sampled (``lag > 0``); with them the update reports the truncated
importance weight's mean, max and truncated fraction (``iw_*``).

The state lives on the policy's mesh: parameters and Adam moments keep the policy's
shardings (`sharding.RULES`), micro-batch rows are split over ``data`` × ``fsdp``, and
the update runs under that mesh (the model's activation constraints apply).

With a drafter to train (``drafter.train``), the same update distils it from the policy
(NeMo-RL's ``L = L_policy + λ·L_draft``; ReSpec's online drafter): the policy's logits
of the step's forward, stop-gradient, are the teacher of the drafter's forward on the
same tokens; the drafter has its own optimizer state, on the same mesh by the same
rules (losses.py holds the divergences and the per-sequence weights). A draft head
(MTP, Eagle3: ``head_sft.HEADS``) reads the policy's hidden states: the same forward
also returns the layers the head reads, stop-gradient like the logits, and the head
trains with its kind's loss, the one SFT uses (`head_sft.head_distill`), its positions
weighted by the drafter weights. (Eagle3's loss renormalises each draft step ``s`` over
the positions ``j >= s``; response positions all satisfy that when prompts are longer
than ``ttt_steps``, and then the micro-batches' losses add up to the mini-batch's.)

A non-finite loss or gradient leaves that model's state unchanged (the step is skipped
inside the jitted update) and is reported as ``skipped`` (``draft_skipped``).

Shape legend: N responses, m responses per micro-batch, T time (prompt + response,
right-padded), T_b a micro-batch's trimmed time, V vocab.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from spec_rl_jax import head_sft, sharding
from spec_rl_jax.config import DrafterTrainConfig, LearnerConfig
from spec_rl_jax.models import mtp
from spec_rl_jax.models.layout import (chunk_rows, training_compiler_options,
                                       training_forward_tokens)
from spec_rl_jax.models.transformer import Decoder, teacher_forced
from spec_rl_jax.rl import losses

# Per-micro-batch sums reduced into the step's metrics (``count`` = response tokens).
_SUMS = ("count", "clipped", "entropy", "kl", "gap_abs", "ratio", "draft_accept")
# What the accumulator carries besides the gradients (the losses: weighted sums).
_STATS = ("loss", "draft_loss", *_SUMS)
BUCKETS = 8  # micro-batch lengths per T (`padded_len`)


def pack_rollouts(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                  old_logprobs: Sequence[np.ndarray], advantages: np.ndarray,
                  rewards: np.ndarray, T: int, pad_id: int,
                  lags: Sequence[np.ndarray] | None = None) -> dict[str, np.ndarray]:
  """Right-padded next-token arrays of prompt + response sequences.

  Returns ``tokens[N, T]`` inputs, ``targets[N, T]`` next tokens, ``valid[N, T]``,
  ``mask[N, T]`` (1 where the target is a response token), ``old_logp[N, T]`` (the
  rollout's ``log π_old`` of each target, 0 elsewhere), ``lag[N, T]`` (how many updates
  the learner's parameters are ahead of those that sampled each response token: its
  staleness; ``lags`` None: all 0), ``adv[N]`` and ``reward[N]``.
  """
  N = len(prompts)
  out = {"tokens": np.full((N, T), pad_id, np.int32),
         "targets": np.full((N, T), pad_id, np.int32),
         "valid": np.zeros((N, T), bool), "mask": np.zeros((N, T), np.float32),
         "old_logp": np.zeros((N, T), np.float32), "lag": np.zeros((N, T), np.int32),
         "adv": np.asarray(advantages, np.float32).reshape(N),
         "reward": np.asarray(rewards, np.float32).reshape(N)}
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
    if lags is not None:
      out["lag"][i, P - 1:n] = lags[i]
  return out


def make_optimizer(cfg: LearnerConfig | DrafterTrainConfig) -> optax.GradientTransformation:
  """AdamW behind global-norm clipping; linear warmup to a constant ``lr`` (update
  ``u`` = 0, 1, ... uses ``lr · min((u + 1) / warmup_steps, 1)``: the first one learns)."""
  warmup = max(cfg.warmup_steps, 1)
  schedule = lambda count: cfg.lr * jnp.minimum((count + 1) / warmup, 1.0)  # noqa: E731
  return optax.chain(optax.clip_by_global_norm(cfg.clip_norm),
                     optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2,
                                 weight_decay=cfg.weight_decay))


@dataclasses.dataclass(frozen=True)
class DistillParams:
  """The drafter's loss: a `losses.DISTILL_LOSSES` name, λ, the sampling temperature;
  for a draft head, its `head_sft.HEADS` kind (None: a draft `Decoder`), the policy
  layers it reads and its non-trained variables (e.g. Eagle3's vocabulary tables)."""

  loss: str
  loss_weight: float
  temperature: float
  head: str | None = None
  hidden_layers: tuple[int, ...] = ()
  frozen: Any = None


def target_logp(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """``log π(target)`` of ``logits[m, T, V]`` at ``targets[m, T]`` → ``[m, T]``."""
  return jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1)[..., 0]


def score_targets(params, micros, *, graphdef):
  """``log π_params(target)`` ``[n, c, T_b]`` of micro-batch chunks ``[n, c, T_b]``
  (the proximal policy's log-probs: no gradient)."""
  def body(carry, mb):
    logits = teacher_forced(graphdef, params, mb["tokens"], mb["valid"]).logits
    return carry, target_logp(logits, mb["targets"])

  return jax.lax.scan(body, None, micros)[1]


def _micro_loss(trainable, ref_params, mb, *, graphdef, draft_graphdef, loss_name: str,
                p: losses.LossParams, distill: DistillParams | None):
  """``Σ w ℓ + λ Σ w_d d`` over one micro-batch, plus the per-token sums for metrics.

  ``trainable = (policy params, drafter params or None)``. One policy forward serves
  the policy loss and, stop-gradient, as the drafter's teacher, so the drafter adds
  only its own forward and backward, and its loss sends no gradient into the policy.
  """
  params, draft_params = trainable
  hidden_layers = distill.hidden_layers if draft_params is not None else ()
  out = teacher_forced(graphdef, params, mb["tokens"], mb["valid"], hidden_layers)
  logits = out.logits  # [m, T, V]
  logp = target_logp(logits, mb["targets"])
  loss_fn = losses.get_policy_loss(loss_name)
  proximal = {"prox_logp": mb["prox_logp"]} if losses.takes_proximal(loss_fn) else {}
  per_token, clipped = loss_fn(logp, mb["old_logp"], mb["adv"], p, **proximal)
  m = mb["mask"]
  kl = jnp.zeros_like(logp)
  if ref_params is not None:
    ref_logp = target_logp(teacher_forced(graphdef, ref_params, mb["tokens"],
                                          mb["valid"]).logits, mb["targets"])
    kl = losses.kl_k3(logp, jax.lax.stop_gradient(ref_logp))
    per_token = per_token + p.kl_coef * kl
  loss = (per_token * mb["weight"]).sum()
  sg = jax.lax.stop_gradient
  sums = {"loss": loss, "count": m.sum(), "clipped": (clipped * m).sum(),
          "entropy": (sg(losses.entropy(logits)) * m).sum(),
          "kl": (sg(kl) * m).sum(),
          "gap_abs": (jnp.abs(sg(logp) - mb["old_logp"]) * m).sum(),
          "ratio": (jnp.exp(sg(logp) - mb["old_logp"]) * m).sum(),
          "draft_loss": jnp.float32(0), "draft_accept": jnp.float32(0)}
  if draft_params is None:
    return loss, sums
  distill_fn = _decoder_distill if distill.head is None else _head_distill
  sums["draft_loss"], student, teacher = distill_fn(
      draft_params, sg(out), mb, graphdef=graphdef, params=params,
      draft_graphdef=draft_graphdef, distill=distill)
  scale = 1.0 / distill.temperature if distill.temperature > 0 else 1.0
  alpha = losses.acceptance_prob(sg(student) * scale, sg(teacher) * scale)
  sums["draft_accept"] = (alpha * m).sum()
  return loss + distill.loss_weight * sums["draft_loss"], sums


def _decoder_distill(draft_params, out, mb, *, graphdef, params, draft_graphdef, distill):
  """A draft `Decoder`'s ``(L_draft = Σ w_d d, its logits, the policy's logits)``."""
  del graphdef, params
  draft_logits = teacher_forced(draft_graphdef, draft_params, mb["tokens"], mb["valid"]).logits
  d = losses.distill_loss(distill.loss, draft_logits, out.logits, distill.temperature)
  return (d * mb["draft_weight"]).sum(), draft_logits, out.logits


def _head_distill(draft_params, out, mb, *, graphdef, params, draft_graphdef, distill):
  """A draft head's ``(L_draft, its first draft's logits, the policy's on the head's
  vocabulary)``: its kind's loss (`head_sft.head_distill`) on the policy's outputs
  ``out`` and embedding and LM head tables, all stop-gradient, positions weighted by
  the drafter weights ``w_d``. The kind's options (e.g. Eagle3's unrolled draft steps)
  are its defaults: the rollouts' config does not name them."""
  kind = head_sft.head_kind(distill.head)
  head = nnx.merge(draft_graphdef, draft_params, distill.frozen)
  tables = jax.lax.stop_gradient(mtp.policy_tables(graphdef, params))
  loss, _, step_logits, teacher = head_sft.head_distill(
      head, tables, out, mb["tokens"], mb["valid"], mb["draft_weight"], kind, kind.Options())
  return loss, step_logits[0], teacher


def accumulate_grads(acc, trainable, ref_params, micros, **loss_kw):
  """``acc + Σ_micro (∇ L, {_STATS})`` over micro-batches ``[n_g, m, T_b]``;
  ``trainable = (policy params, drafter params or None)``, gradients likewise."""
  grad_fn = jax.grad(_micro_loss, has_aux=True)

  def body(acc, micro):
    grads, sums = grad_fn(trainable, ref_params, micro, **loss_kw)
    return jax.tree.map(jnp.add, acc, (grads, sums)), None

  return jax.lax.scan(body, acc, micros)[0]


def _guarded_step(tx, params, opt, grads, loss):
  """``(params, opt, grad_norm, ok)`` after one step of ``tx``; a non-finite loss or
  gradient norm keeps ``params`` and ``opt``."""
  grad_norm = optax.tree.norm(grads)
  updates, new_opt = tx.update(grads, opt, params)
  new = (optax.apply_updates(params, updates), new_opt)
  ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  new = jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, (params, opt))
  return *new, grad_norm, ok


def apply_grads(state, grads, stats, *, tx, draft_tx):
  """One optimizer step on ``state = {"params", "opt"[, "draft", "draft_opt"]}`` from
  accumulated ``grads = (policy, drafter or None)``.

  Returns ``(state, metrics)``. The two models step independently: a non-finite loss or
  gradient norm keeps that model's old state (``skipped`` / ``draft_skipped`` = 1), so a
  NaN in the drafter's loss never reaches the policy.
  """
  policy_grads, draft_grads = grads
  new = dict(state)
  new["params"], new["opt"], grad_norm, ok = _guarded_step(
      tx, state["params"], state["opt"], policy_grads, stats["loss"])
  n = jnp.maximum(stats["count"], 1.0)
  metrics = {"loss": stats["loss"], "grad_norm": grad_norm,
             "skipped": 1 - ok.astype(jnp.int32),
             "clip_frac": stats["clipped"] / n, "entropy": stats["entropy"] / n,
             "kl": stats["kl"] / n, "logprob_gap": stats["gap_abs"] / n,
             "ratio_mean": stats["ratio"] / n}
  if draft_grads is not None:
    new["draft"], new["draft_opt"], draft_norm, draft_ok = _guarded_step(
        draft_tx, state["draft"], state["draft_opt"], draft_grads, stats["draft_loss"])
    metrics.update(draft_loss=stats["draft_loss"], draft_grad_norm=draft_norm,
                   draft_skipped=1 - draft_ok.astype(jnp.int32),
                   draft_acceptance=stats["draft_accept"] / n)
  return new, metrics


class Learner:
  """Holds ``{"params", "opt"}`` of the policy (and a frozen reference when β > 0);
  with a ``drafter`` and ``draft_cfg``, also ``{"draft", "draft_opt"}``: the drafter
  distilled from the policy in the same update (`update(..., train_draft=True)`); a
  draft head names its ``head_sft.HEADS`` kind in ``draft_head`` (``{"draft"}`` holds its
  ``nnx.Param`` s, its other variables stay as they are)."""

  def __init__(self, model: Decoder, cfg: LearnerConfig, max_response_len: int,
               drafter: nnx.Module | None = None,
               draft_cfg: DrafterTrainConfig | None = None, temperature: float = 1.0,
               draft_head: str | None = None):
    self.cfg, self.max_response_len, self.draft_cfg = cfg, max_response_len, draft_cfg
    self.graphdef, params = nnx.split(model)
    params = nnx.to_pure_dict(params)
    self.tx = make_optimizer(cfg)
    leaf = jax.tree.leaves(params)[0]
    self.mesh = mesh = (leaf.sharding.mesh if isinstance(leaf.sharding, NamedSharding)
                        else sharding.make_mesh((1, 1, 1)))
    replicated = NamedSharding(mesh, P())
    self._forward_tokens = training_forward_tokens()
    self.state = {"params": params, "opt": self._init_opt(self.tx, params)}
    self.draft_graphdef, self.draft_tx, distill = None, None, None
    if drafter is not None:
      if draft_cfg is None:
        raise ValueError("a drafter to train needs its DrafterTrainConfig")
      distill = self._distill_params(model, drafter, draft_cfg, temperature, draft_head)
      self.draft_graphdef, draft, frozen = nnx.split(drafter, nnx.Param, ...)
      # The drafter's weights and moments follow the same sharding rules on the same mesh.
      draft = nnx.to_pure_dict(sharding.device_put_state(draft, mesh))
      self._draft_frozen = sharding.device_put_state(frozen, mesh)
      distill = dataclasses.replace(distill, frozen=self._draft_frozen)
      self.draft_tx = make_optimizer(draft_cfg)
      self.state.update(draft=draft, draft_opt=self._init_opt(self.draft_tx, draft))
    # β > 0: a frozen copy of the initial policy (a separate buffer: state is donated).
    self.ref_params = (jax.tree.map(jnp.copy, params) if cfg.kl_coef > 0 else None)
    self.loss_params = losses.LossParams(cfg.clip_eps_low, cfg.clip_eps_high, cfg.kl_coef,
                                         cfg.importance_cap)
    self.takes_proximal = losses.takes_proximal(losses.get_policy_loss(cfg.loss))
    # The state keeps its shardings across steps (donated in place, one compile; the
    # engine's copy of the weights keeps its compiled programs too). Gradients are laid
    # out like the parameters; the per-micro-batch sums are replicated scalars. One
    # program pair per mode: with and without the drafter's update.
    state_shardings = jax.tree.map(lambda x: x.sharding, self.state)
    stats_shardings = {k: replicated for k in _STATS}
    loss_kw = dict(graphdef=self.graphdef, draft_graphdef=self.draft_graphdef,
                   loss_name=cfg.loss, p=self.loss_params, distill=distill)
    self._zeros, self._accumulate = {}, {}
    for with_draft in ((False, True) if drafter is not None else (False,)):
      grad_shardings = (state_shardings["params"],
                        state_shardings["draft"] if with_draft else None)
      acc_shardings = (grad_shardings, stats_shardings)
      self._zeros[with_draft] = jax.jit(
          lambda trainable: (jax.tree.map(jnp.zeros_like, trainable),
                             {k: jnp.float32(0) for k in _STATS}),
          out_shardings=acc_shardings)
      self._accumulate[with_draft] = jax.jit(
          functools.partial(accumulate_grads, **loss_kw), donate_argnums=0,
          out_shardings=acc_shardings, compiler_options=training_compiler_options())
    # Replicated: every process reads the log-probs back whole (multi-host).
    self._score = jax.jit(functools.partial(score_targets, graphdef=self.graphdef),
                          out_shardings=replicated,
                          compiler_options=training_compiler_options())
    self._apply = jax.jit(functools.partial(apply_grads, tx=self.tx, draft_tx=self.draft_tx),
                          donate_argnums=0, out_shardings=(state_shardings, replicated),
                          compiler_options=training_compiler_options())

  @staticmethod
  def _distill_params(model: Decoder, drafter: nnx.Module, draft_cfg: DrafterTrainConfig,
                      temperature: float, draft_head: str | None) -> DistillParams:
    """The drafter's `DistillParams`; raises for a drafter this policy cannot teach."""
    if draft_head is None:
      if drafter.cfg.vocab_size != model.cfg.vocab_size:
        raise ValueError(f"the drafter's vocabulary ({drafter.cfg.vocab_size} tokens)"
                         f" differs from the policy's ({model.cfg.vocab_size}): it cannot"
                         " be distilled from the policy's next-token distributions")
      return DistillParams(draft_cfg.loss, draft_cfg.loss_weight, temperature)
    head_sft.head_kind(draft_head)
    drafter.cfg.check_policy(model.cfg)
    if draft_cfg.loss != "forward_kl":
      raise ValueError(f"drafter.train.loss={draft_cfg.loss!r}: the {draft_head} head trains"
                       " with its kind's loss (head_sft: forward KL); set"
                       " drafter.train.loss=forward_kl")
    return DistillParams(draft_cfg.loss, draft_cfg.loss_weight, temperature, draft_head,
                         tuple(drafter.cfg.hidden_layers))

  def _init_opt(self, tx: optax.GradientTransformation, params: Any) -> Any:
    """``tx``'s state with Adam's moments laid out like ``params``; counters replicated."""
    opt_shardings = optax.tree_map_params(
        tx, lambda _, s: s, jax.eval_shape(tx.init, params),
        jax.tree.map(lambda x: x.sharding, params),
        transform_non_params=lambda _: NamedSharding(self.mesh, P()))
    return jax.jit(tx.init, out_shardings=opt_shardings)(params)

  def model(self) -> Decoder:
    """The current policy as a `Decoder` (shares the learner's buffers)."""
    return nnx.merge(self.graphdef, self.state["params"])

  def draft_model(self) -> nnx.Module | None:
    """The drafter being trained, a `Decoder` or a head (None: the learner trains none;
    shares the learner's buffers)."""
    if self.draft_graphdef is None:
      return None
    return nnx.merge(self.draft_graphdef, self.state["draft"], self._draft_frozen)

  def check_batch_size(self, N: int) -> None:
    """``N`` responses must split into mini-batches of whole micro-batches."""
    k, m = self.cfg.num_minibatches, self.cfg.micro_batch_size
    if N % k or (N // k) % m:
      raise ValueError(f"{N} responses per step (prompts_per_step x group_size) do not"
                       f" split into learner.num_minibatches={k} mini-batches of"
                       f" micro-batches of learner.micro_batch_size={m}")

  def minibatches(self, batch: dict[str, np.ndarray]) -> list[list[dict[str, np.ndarray]]]:
    """Splits ``N`` responses into mini-batches of `micro_batches`, with each token's
    policy-loss weight (``weight``) and, when a drafter trains, drafter-loss weight
    (``draft_weight``), both normalised over the mini-batch; and, when the loss takes
    the proximal policy, its log-probs (``prox_logp``) at the current parameters."""
    N = batch["adv"].shape[0]
    self.check_batch_size(N)
    out = []
    for part in np.split(np.arange(N), self.cfg.num_minibatches):
      mb = {key: v[part] for key, v in batch.items()}
      mb["weight"] = losses.aggregation_weights(self.cfg.aggregation, mb["mask"],
                                                self.max_response_len)
      if self.draft_cfg is not None:
        mb["draft_weight"] = losses.draft_weights(self.draft_cfg.weighting, mb["mask"],
                                                  mb["reward"],
                                                  self.draft_cfg.reward_temperature)
      groups = micro_batches(mb, self.cfg.micro_batch_size)
      for group in groups:
        lag = group.pop("lag", None)
        if self.takes_proximal:
          group["prox_logp"] = self.proximal_logprobs(group, lag)
      out.append(groups)
    return out

  def proximal_logprobs(self, group: dict[str, np.ndarray],
                        lag: np.ndarray | None) -> np.ndarray:
    """``log π_prox [n_g, m, T_b]`` of a micro-batch group at the current parameters.

    Tokens of staleness 0 (``lag`` 0 or None) were sampled by these very parameters:
    they keep the engine's ``old_logp`` (the same policy; a recomputation would differ
    only by float noise), so a fresh batch costs no forward and decoupled PPO is
    ``ppo_clip`` exactly. The others are recomputed by a teacher-forced forward.
    """
    stale = np.zeros(group["old_logp"].shape, bool) if lag is None else lag > 0
    if not stale.any():
      return group["old_logp"]
    placed = self._place({k: group[k] for k in ("tokens", "targets", "valid")})
    with jax.set_mesh(self.mesh):
      logp = self._score(self.state["params"], placed)
    logp = np.asarray(jax.device_get(logp)).reshape(stale.shape)
    return np.where(stale, logp, group["old_logp"]).astype(np.float32)

  def _place(self, micros: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    """Micro-batches ``[n_g, m, ...]`` in `chunk_rows` chunks ``[n_g·m/c, c, ...]``,
    with their ``c`` rows split over the mesh's batch axes (``data`` × ``fsdp``, where
    ``c`` divides; else replicated)."""
    shape = dict(self.mesh.shape)
    n_g, m, width = micros["tokens"].shape
    c = chunk_rows(m, width, self._forward_tokens, shape["data"] * shape["fsdp"])
    micros = {k: v.reshape(n_g * m // c, c, *v.shape[2:]) for k, v in micros.items()}
    return {k: jax.device_put(v, NamedSharding(self.mesh, sharding.logical_to_spec(
        (None, "batch", *(None,) * (v.ndim - 2)), v.shape, shape))) for k, v in micros.items()}

  def gradients(self, groups: list[dict[str, np.ndarray]],
                train_draft: bool = False) -> tuple[Any, dict[str, jax.Array]]:
    """``((∇_θ, ∇_draft or None), {_STATS})`` of one mini-batch's micro-batch groups,
    accumulated on device at the current parameters."""
    trainable = (self.state["params"], self.state["draft"] if train_draft else None)
    with jax.set_mesh(self.mesh):
      acc = self._zeros[train_draft](trainable)
      for group in groups:
        acc = self._accumulate[train_draft](acc, trainable, self.ref_params,
                                            self._place(group))
    return acc

  def update(self, batch: dict[str, np.ndarray], train_draft: bool = False) -> dict[str, Any]:
    """One step on a packed global batch (`pack_rollouts`); returns its metrics.

    ``train_draft``: the drafter takes an optimizer step on the same mini-batches,
    distilled from the policy's logits of the same forward (the policy before this
    mini-batch's step). ``logprob_gap`` (mean |log π_θ - log π_old| over response
    tokens) is taken from the first mini-batch, whose forward still uses the rollout's
    parameters; so is ``draft_acceptance`` (mean ``α_t``: the drafter as the rollout
    used it against the rollout's policy). ``positions_computed_frac``: the share of
    the batch's ``N × T`` positions the micro-batches' forward and backward passes
    compute (`micro_batches` trims padding).
    """
    if train_draft and self.draft_graphdef is None:
      raise ValueError("train_draft=True but the learner holds no drafter")
    metrics, computed = [], 0
    parts = self.minibatches(batch)
    for groups in parts:
      acc = self.gradients(groups, train_draft)
      computed += sum(group["tokens"].size for group in groups)
      with jax.set_mesh(self.mesh):
        self.state, m = self._apply(self.state, *acc)
      metrics.append(jax.device_get(m))
    out = {k: float(np.mean([m[k] for m in metrics])) for k in metrics[0]}
    for first in ("logprob_gap", "draft_acceptance"):
      if first in out:
        out[first] = float(metrics[0][first])
    out["skipped"] = int(sum(m["skipped"] for m in metrics))
    if train_draft:
      out["draft_skipped"] = int(sum(m["draft_skipped"] for m in metrics))
    out["positions_computed_frac"] = computed / batch["tokens"].size
    if self.takes_proximal:
      out.update(self._importance_stats([g for groups in parts for g in groups]))
    return out

  def _importance_stats(self, groups: list[dict[str, np.ndarray]]) -> dict[str, float]:
    """Over response tokens: the mean and max of the truncated importance weight
    ``w = min(π_prox / π_behav, c)`` and the fraction truncated (``π_prox / π_behav >
    c``)."""
    ratio = np.concatenate([np.exp(g["prox_logp"] - g["old_logp"])[g["mask"] > 0]
                            for g in groups])
    if not ratio.size:
      return {"iw_mean": 1.0, "iw_max": 1.0, "iw_truncated_frac": 0.0}
    cap = self.cfg.importance_cap
    w = np.minimum(ratio, cap)
    return {"iw_mean": float(w.mean()), "iw_max": float(w.max()),
            "iw_truncated_frac": float((ratio > cap).mean())}


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
