"""Training draft heads (Eagle3, MTP) against a frozen policy: the head kinds `sft.py`
trains when a target sets ``head``.

Every step runs the policy teacher-forced on an SFT batch (its logits are the teacher,
its hidden states the heads' input; no gradient reaches it) and distils the heads'
drafts into the policy's next-token distributions ``p_j`` over the response tokens:

  eagle3  Eagle3's training-time test (`eagle3.training_time_test`) over ``ttt_steps``
          draft steps: step ``s`` at position ``j`` is the ``s``-th draft of a round
          that started at ``j - s``, fed the head's own outputs as drafting does.
          ``L = Σ_s 0.8^s KL(p_j || q^s_j)`` (EAGLE-3's step weights: a later draft
          counts only once the earlier ones are accepted), ``p`` renormalised over the
          draft vocabulary.
  mtp     the D_m modules' chain (`mtp.forward`); ``L = (1/D_m) Σ_d KL(p_j || q^d_j)``
          (DeepSeek-V3's average over modules, with the policy's distribution in place
          of the data token).

The held-out measure is the teacher-forced acceptance probability of each draft step,
``α_s = E[Σ_v min(p_j(v), q^s_j(v))]``: the chance the verifier accepts draft ``s``
given the earlier ones were (Leviathan et al., 2023).

Shape legend: ``B`` batch, ``T`` time, ``V`` vocab, ``D`` model dim, ``s`` draft steps.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from spec_rl_jax import checkpoint, data
from spec_rl_jax.models import eagle3, eagle3_io, mtp
from spec_rl_jax.models.layout import training_compiler_options
from spec_rl_jax.models.tokenizer import Tokenizer
from spec_rl_jax.models.transformer import Decoder, teacher_forced
from spec_rl_jax.rl import losses

STEP_DECAY = 0.8  # Eagle3: weight of draft step s is STEP_DECAY ** s


@dataclasses.dataclass(frozen=True)
class Eagle3Options:
  """``feature_layers``: inputs of these policy layers are fused (empty: the serving
  stacks' default); ``ttt_steps``: draft steps unrolled in training."""

  feature_layers: tuple[int, ...] = ()
  ttt_steps: int = 3

  def __post_init__(self):
    if self.ttt_steps < 1:
      raise ValueError(f"ttt_steps must be >= 1, got {self.ttt_steps}")


@dataclasses.dataclass(frozen=True)
class MTPOptions:
  """``num_modules``: D_m, the most drafts a round can take from the heads."""

  num_modules: int = 4


@dataclasses.dataclass(frozen=True)
class HeadKind:
  """How one kind of head is made, run teacher-forced, trained and saved.

  ``step_logits(head, tables, tokens, policy_out, valid, options) -> [s, B, T, Vd]``:
  every draft step's logits at every position (``tables``: the policy's embedding and
  LM head); ``teacher(head, logits [B, T, V]) -> [B, T, Vd]``: the policy's logits on the
  drafts' vocabulary; ``loss(step_logits, teacher, weight) -> (loss, {name: scalar})``,
  ``weight [B, T]`` the positions' weights, summing to 1 over the batch the loss
  averages (`mask_weights` here; the RL learner's drafter weights, rl/learner.py).
  """

  Options: type
  make: Callable[[Decoder, Any, str, int], nnx.Module]  # (policy, options, fingerprint, seed)
  step_logits: Callable[..., jax.Array]
  teacher: Callable[[nnx.Module, jax.Array], jax.Array]
  loss: Callable[..., tuple[jax.Array, dict]]
  save: Callable[[nnx.Module, str], None]


def _eagle3_make(policy: Decoder, options: Eagle3Options, fingerprint: str, seed: int):
  cfg = eagle3.Eagle3Config.for_policy(policy.cfg, options.feature_layers,
                                       fingerprint=fingerprint)
  return eagle3.init_head(cfg, seed)


def _eagle3_logits(head, tables, tokens, policy_out, valid, options: Eagle3Options):
  e = jnp.take(tables.embed, tokens, axis=0)
  return eagle3.training_time_test(head, e, policy_out.hidden, valid, options.ttt_steps)


def _eagle3_loss(step_logits, teacher, weight):
  """Step ``s`` averages over the positions ``j >= s`` (a round that started at
  ``j - s``), renormalised to ``weight``'s total mass."""
  loss, metrics = 0.0, {}
  T = weight.shape[1]
  total = weight.sum()
  for s in range(step_logits.shape[0]):
    m = weight * (jnp.arange(T) >= s)[None, :]
    kl = (losses.distill_loss("forward_kl", step_logits[s], teacher) * m).sum()
    kl = kl * total / jnp.maximum(m.sum(), jnp.finfo(jnp.float32).tiny)
    loss = loss + STEP_DECAY ** s * kl
    metrics[f"kl_{s}"] = kl
  return loss, metrics


def _mtp_make(policy: Decoder, options: MTPOptions, fingerprint: str, seed: int):
  return mtp.init_heads(mtp.MTPConfig(options.num_modules, policy.cfg, fingerprint), seed)


def _mtp_logits(heads, tables, tokens, policy_out, valid, options: MTPOptions):
  del options
  return mtp.forward(heads, tables, tokens, policy_out.hidden[0], valid)


def _mtp_loss(step_logits, teacher, weight):
  loss, m = mtp.distill_loss(step_logits, teacher, weight)
  return loss, {f"kl_{d}": kl for d, kl in enumerate(m["kl"])}


HEADS: dict[str, HeadKind] = {
    "eagle3": HeadKind(Eagle3Options, _eagle3_make, _eagle3_logits,
                       lambda head, logits: logits[..., head.target_ids()], _eagle3_loss,
                       eagle3_io.save_eagle3),
    "mtp": HeadKind(MTPOptions, _mtp_make, _mtp_logits, lambda heads, logits: logits,
                    _mtp_loss, mtp.save_mtp),
}


def head_kind(name: str) -> HeadKind:
  if name not in HEADS:
    raise ValueError(f"unknown head {name!r}; known: {sorted(HEADS)}")
  return HEADS[name]


def parse_options(kind: str, options: Sequence[tuple[str, Any]]):
  """The kind's options dataclass from ``(name, value)`` pairs (unknown names refused)."""
  cls = head_kind(kind).Options
  valid = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(dict(options)) - valid)
  if unknown:
    raise ValueError(f"unknown {kind} option(s) {unknown}; valid: {sorted(valid)}")
  return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in options})


def _policy_pass(policy_graphdef, policy_params, head, tokens, valid):
  """The frozen policy's teacher-forced outputs (with the head's hidden layers) and its
  embedding and LM head tables, without gradient."""
  out = teacher_forced(policy_graphdef, policy_params, tokens, valid, head.cfg.hidden_layers)
  tables = mtp.policy_tables(policy_graphdef, policy_params)
  return jax.lax.stop_gradient((out, tables))


def mask_weights(mask: jax.Array) -> jax.Array:
  """``mask / Σ mask``: the positions' weights of a loss averaged over ``mask``."""
  return mask / jnp.maximum(mask.sum(), 1.0)


def head_distill(head, tables, policy_out, tokens, valid, weight, kind: HeadKind, options):
  """``(loss, metrics, step_logits, teacher)``: the kind's distillation loss of ``head``
  against the policy's outputs ``policy_out`` (stop-gradient) on ``tokens``, positions
  weighted by ``weight`` (`HeadKind`). The one head loss of SFT and of RL's online
  drafter training."""
  step_logits = kind.step_logits(head, tables, tokens, policy_out, valid, options)
  teacher = kind.teacher(head, policy_out.logits)
  loss, metrics = kind.loss(step_logits, teacher, weight)
  return loss, metrics, step_logits, teacher


def head_loss(head, tables, policy_out, batch, kind: HeadKind, options):
  """The kind's distillation loss of ``head`` on ``batch`` (averaged over the response
  positions), with the step-0 top-1 agreement with the policy among its metrics."""
  loss, metrics, step_logits, teacher = head_distill(
      head, tables, policy_out, batch["tokens"], batch["valid"],
      mask_weights(batch["loss_mask"]), kind, options)
  agree = (step_logits[0].argmax(-1) == teacher.argmax(-1)) * batch["loss_mask"]
  metrics["top1_agreement"] = agree.sum() / jnp.maximum(batch["loss_mask"].sum(), 1.0)
  return loss, {**metrics, "loss": loss}


def train_step(graphdef, state, batch, policy_params, *, policy_graphdef, tx, kind, options):
  """One optimizer step of the head's parameters (``state = {"params", "opt", "step",
  "frozen"}``; ``frozen``: its non-trained variables, e.g. Eagle3's ``d2t``, carried
  along so that checkpoints hold the whole head)."""
  rest = state["frozen"]
  frozen = nnx.merge(graphdef, state["params"], rest)
  policy_out, tables = _policy_pass(policy_graphdef, policy_params, frozen, batch["tokens"],
                                    batch["valid"])

  def loss_fn(params):
    return head_loss(nnx.merge(graphdef, params, rest), tables, policy_out, batch, kind,
                     options)

  (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
  updates, opt = tx.update(grads, state["opt"], state["params"])
  metrics["grad_norm"] = optax.tree.norm(grads)
  return {"params": optax.apply_updates(state["params"], updates), "opt": opt,
          "step": state["step"] + 1, "frozen": rest}, metrics


@dataclasses.dataclass
class Trainee:
  """What `sft.train` needs of a model it trains: its parameters, a jitted step
  ``(state, batch) -> (state, metrics)``, the module from a (final) state, the run's meta
  entry describing it (``{"model": ...}`` for a decoder, ``{"draft_head": ...}`` for
  heads, as RL runs record them) and state entries the step carries unchanged."""

  params: Any
  step: Callable[[dict, dict], tuple[dict, dict]]
  merge: Callable[[dict], nnx.Module]
  meta: dict
  extra_state: dict = dataclasses.field(default_factory=dict)


def load_policy(path: str, tokenizer: Tokenizer) -> Decoder:
  """The frozen policy at ``path`` (under the cache unless absolute); its tokenizer must
  be the run's."""
  path = checkpoint.resolve_path(path)
  policy, tok = checkpoint.load_model(path)
  if tok is not None and tok.backend.to_str() != tokenizer.backend.to_str():
    raise ValueError(f"policy {path} uses a different tokenizer than the run")
  return policy


def trainee(kind_name: str, options, policy: Decoder, tokenizer: Tokenizer, seed: int,
            tx: optax.GradientTransformation) -> Trainee:
  """A fresh head of ``kind_name`` for ``policy`` and its training step."""
  kind = head_kind(kind_name)
  fingerprint = eagle3.policy_fingerprint(policy.cfg, tokenizer.backend.get_vocab())
  head = kind.make(policy, options, fingerprint, seed)
  graphdef, params, rest = nnx.split(head, nnx.Param, ...)
  policy_graphdef, policy_state = nnx.split(policy)
  policy_params = nnx.to_pure_dict(policy_state)
  step = jax.jit(functools.partial(train_step, graphdef, policy_graphdef=policy_graphdef,
                                   tx=tx, kind=kind, options=options),
                 donate_argnums=0, compiler_options=training_compiler_options())

  def merge(state):
    trained, frozen = (jax.tree.map(lambda x: x, part) for part in (params, rest))
    nnx.replace_by_pure_dict(trained, state["params"])
    nnx.replace_by_pure_dict(frozen, state["frozen"])
    return nnx.merge(graphdef, trained, frozen)

  return Trainee(params=nnx.to_pure_dict(params),
                 step=lambda state, batch: step(state, batch, policy_params), merge=merge,
                 meta={"draft_head": {"kind": kind_name, **dataclasses.asdict(head.cfg)}},
                 extra_state={"frozen": nnx.to_pure_dict(rest)})


def acceptance(head, kind_name: str, options, policy: Decoder, tokenizer: Tokenizer,
               sources: Sequence[data.Source], n: int, max_len: int,
               batch_size: int = 16) -> dict[str, float]:
  """Held-out teacher-forced acceptance ``α_s`` of each draft step and the top-1
  agreement of step 0 (``n`` examples of the held-out split)."""
  kind = head_kind(kind_name)
  policy_graphdef, policy_state = nnx.split(policy)
  policy_params = nnx.to_pure_dict(policy_state)

  @jax.jit
  def score(batch):
    out, tables = _policy_pass(policy_graphdef, policy_params, head, batch["tokens"],
                               batch["valid"])
    q = kind.step_logits(head, tables, batch["tokens"], out, batch["valid"], options)
    p = kind.teacher(head, out.logits)
    alpha = jax.vmap(lambda qs: losses.acceptance_prob(qs, p))(q)  # [s, B, T]
    return alpha, q[0].argmax(-1) == p.argmax(-1)

  batches = data.sft_batches(sources, tokenizer, batch_size, max_len, split="test")
  alphas, agree, seen = [], [], 0
  for batch in batches:
    alpha, top1 = jax.device_get(score({k: batch[k] for k in ("tokens", "valid")}))
    mask = batch["loss_mask"].astype(bool)
    alphas.append([a[mask & (np.arange(mask.shape[1]) >= s)] for s, a in enumerate(alpha)])
    agree.append(top1[mask])
    seen += len(batch["tokens"])
    if seen >= n:
      break
  out = {f"alpha_{s}": float(np.concatenate([a[s] for a in alphas]).mean())
         for s in range(len(alphas[0]))}
  out["top1_agreement"] = float(np.concatenate(agree).mean())
  return out
