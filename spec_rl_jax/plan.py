"""Per-chip memory plan of a recipe, from shapes alone: ``python -m spec_rl_jax.plan``.

``python -m spec_rl_jax.plan --config configs/qwen3_8b_v5p.yaml [--chip tpu-v5p] [k=v ...]``

prints the bytes each chip of the recipe's mesh holds, component by component, and exits
non-zero when they exceed the chip's memory less a reserve (`RESERVE`). Nothing is
allocated and no weights are read: the models are ``eval_shape``'d from their configs
(a checkpoint's ``config.json`` or run metadata, else the recipe's ``plan.policy_model``
/ ``plan.draft_model`` presets), every array is laid out by `sharding.RULES` on an
``AbstractMesh`` of the recipe's ``policy.mesh``, and a chip's share of an array is its
``NamedSharding.shard_shape``. With the rollout engine on a sub-mesh of its own
(``rollout.mesh``) the learner's chips and the engine's get a plan each. The trainer
runs the same `check` before it loads a weight.

What is counted, per chip:

  * the policy's parameters, Adam moments and gradient accumulator in the learner, the
    frozen reference copy (``learner.kl_coef > 0``) and the rollout engine's copy of the
    weights (the engine never aliases the learner's buffers);
  * the rollout engine's device state (`rollout.device.DevicePrograms.init_state`): the
    policy's paged KV pool, the proposer's state (a draft model's KV pool) and the slot
    bookkeeping;
  * a drafter with weights: the engine's copy, the proposer's own (on the learner's
    mesh) and, when it trains online, its parameters, moments and gradients;
  * the update's activations: the residuals the backward pass of one micro-batch keeps
    (the VJP of the learner's loss, `rl.learner._micro_loss`, traced by ``eval_shape``
    with the recipe's ``learner.rematerialize``) for the rows and the tensor-split
    widths one chip computes, plus, under remat, one layer's recomputed intermediates.

Not counted, hence `RESERVE`: XLA's temporaries (an attention block's scores, the rollout
programs' logits), collective buffers and fragmentation.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import sys
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec as P

from spec_rl_jax import checkpoint, sharding
from spec_rl_jax.config import TrainConfig, load_config
from spec_rl_jax.models import eagle3, eagle3_io, hf_io, mtp
from spec_rl_jax.models.config import ModelConfig, get_preset
from spec_rl_jax.models.transformer import Decoder, abstract_decoder
from spec_rl_jax.rl import learner as rl_learner
from spec_rl_jax.rl import losses
from spec_rl_jax.rollout.device import DevicePrograms
from spec_rl_jax.spec.proposers import base as proposers

GiB = 1 << 30
# Share of a chip's memory kept free for what the plan does not count.
RESERVE = 0.10


class PlanError(ValueError):
  """A recipe that does not fit its chips, or that the plan cannot describe."""


@dataclasses.dataclass(frozen=True)
class Chip:
  """An accelerator kind: its memory and the share of it JAX allocates from."""

  name: str
  memory: int  # bytes per chip
  # JAX's GPU client takes 75% of the memory unless XLA_PYTHON_CLIENT_MEM_FRACTION says
  # otherwise; TPU runtimes hand all of it to XLA.
  fraction: float = 1.0

  @property
  def usable(self) -> int:
    return int(self.memory * self.fraction)

  @property
  def label(self) -> str:
    if self.fraction == 1:
      return self.name
    return f"{self.name}, {self.fraction:.0%} of its memory for JAX"


CHIPS: dict[str, Chip] = {
    "tpu-v4": Chip("TPU v4", 32 * GiB),
    "tpu-v5e": Chip("TPU v5e", 16 * GiB),
    "tpu-v5p": Chip("TPU v5p", 95 * GiB),
    "tpu-v6e": Chip("TPU v6e", 32 * GiB),
    "a100-80gb": Chip("NVIDIA A100 80GB", 80 * 10**9, 0.75),
    "h100-80gb": Chip("NVIDIA H100 80GB", 80 * 10**9, 0.75),
    "h200": Chip("NVIDIA H200", 141 * 10**9, 0.75),
}


@dataclasses.dataclass(frozen=True)
class Plan:
  """Bytes per chip by component (the most any chip of the mesh holds) against the
  memory the chip grants (``capacity``; None: unknown, nothing checked)."""

  mesh: tuple[tuple[str, int], ...]
  rows: tuple[tuple[str, int], ...]
  capacity: int | None
  chip: str  # what ``capacity`` is: a chip of `CHIPS` or the devices' own report
  role: str = ""  # whose chips, when the learner and the engine have their own

  @property
  def total(self) -> int:
    return sum(b for _, b in self.rows)

  @property
  def budget(self) -> int | None:
    """What the counted components may use: the capacity less `RESERVE`."""
    return None if self.capacity is None else int(self.capacity * (1 - RESERVE))

  @property
  def fits(self) -> bool:
    return self.budget is None or self.total <= self.budget

  def table(self) -> str:
    chips = math.prod(n for _, n in self.mesh)
    mesh = " ".join(f"{a}={n}" for a, n in self.mesh)
    width = max(len(name) for name, _ in self.rows) + 2
    whose = f" of the {self.role}" if self.role else ""
    lines = [f"per-chip memory plan{whose}: {chips} chip{'s' * (chips > 1)} ({self.chip}),"
             f" mesh {mesh}",
             *(f"  {name:<{width}}{b / GiB:9.2f} GiB" for name, b in self.rows),
             f"  {'total':<{width}}{self.total / GiB:9.2f} GiB"]
    if self.capacity is None:
      lines.append("  chip memory unknown (set plan.chip or --chip): not checked")
    else:
      free = self.budget - self.total
      lines += [f"  {'chip memory for JAX':<{width}}{self.capacity / GiB:9.2f} GiB",
                f"  {f'usable (less {RESERVE:.0%} reserve)':<{width}}"
                f"{self.budget / GiB:9.2f} GiB",
                f"  {'margin' if free >= 0 else 'OVER BY':<{width}}{abs(free) / GiB:9.2f} GiB"
                + (f" ({free / self.budget:.0%} of usable)" if free >= 0 else "")]
    return "\n".join(lines)

  def error(self) -> str:
    """The refusal, with the plan's numbers."""
    top = sorted(self.rows, key=lambda r: -r[1])[:4]
    whose = f" ({self.role})" if self.role else ""
    return (f"the recipe does not fit {self.chip}{whose}: it needs {self.total / GiB:.2f}"
            f" GiB per chip against {self.budget / GiB:.2f} GiB usable ({self.capacity / GiB:.2f} GiB"
            f" less a {RESERVE:.0%} reserve); largest: "
            + ", ".join(f"{name} {b / GiB:.2f} GiB" for name, b in top)
            + ". Shrink rollout.num_pages, rollout.num_slots or learner.micro_batch_size,"
            " set learner.rematerialize=true, or spread over more chips (policy.mesh,"
            " rollout.mesh; KV pools split over the tensor axis only).\n" + self.table())


# --------------------------------------------------------------------------- shapes


def model_config(path: str, preset: str, key: str) -> ModelConfig:
  """The architecture of the checkpoint at ``path`` read from its config (HF
  ``config.json`` or a run's metadata), else the ``preset`` named by the recipe's
  ``key``; both must agree where both exist."""
  where = checkpoint.resolve_path(path)
  found = None
  if os.path.exists(os.path.join(where, "config.json")):
    with open(os.path.join(where, "config.json")) as f:
      found = hf_io.config_from_hf(json.load(f))
  elif os.path.isdir(os.path.join(where, checkpoint.CKPT_DIR)):
    ckpt = checkpoint.TrainCheckpointer(where)
    try:
      found = checkpoint.config_from_json(ckpt.restore_meta()["model"])
    finally:
      ckpt.close()
  if found is None and not preset:
    raise PlanError(f"{where}: no checkpoint (config.json or a run's {checkpoint.CKPT_DIR}/)"
                    f" to read the architecture from; name it with {key}=<preset>")
  if found is not None and preset and _shape_of(found) != _shape_of(get_preset(preset)):
    raise PlanError(f"{key}={preset} does not describe the checkpoint at {where}:"
                    f" {_shape_of(get_preset(preset))} vs {_shape_of(found)}")
  return found if found is not None else get_preset(preset)


def _shape_of(cfg: ModelConfig) -> dict[str, Any]:
  """The fields that decide a model's array shapes and dtypes."""
  keys = ("vocab_size", "embed_dim", "mlp_dim", "num_layers", "num_heads", "num_kv_heads",
          "head_dim", "tie_embeddings", "param_dtype")
  return {k: getattr(cfg, k) for k in keys}


def abstract_mesh(shape: Sequence[int]) -> AbstractMesh:
  """The recipe's ``(data, fsdp, tensor)`` mesh without devices."""
  return AbstractMesh(tuple(shape), sharding.MESH_AXES)


def _chip_bytes(tree: Any, shardings: Any) -> int:
  """Bytes of one chip's shards of the abstract arrays ``tree``."""
  return sum(math.prod(s.shard_shape(x.shape)) * jnp.dtype(x.dtype).itemsize
             for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings)))


def _abstract_state(model: nnx.Module) -> Any:
  return jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype),
                      nnx.to_pure_dict(nnx.state(model)))


def _weights_bytes(model: nnx.Module, mesh: AbstractMesh) -> int:
  """One chip's share of ``model``'s weights laid out by the rules on ``mesh``."""
  state = nnx.state(model)
  return _chip_bytes(state, sharding.state_shardings(state, mesh))


def _optimizer_bytes(tx: optax.GradientTransformation, model: nnx.Module,
                     mesh: AbstractMesh) -> int:
  """One chip's share of ``tx``'s state, laid out as the learner lays it out (moments
  like the parameters, counters replicated)."""
  opt = jax.eval_shape(tx.init, _abstract_state(model))
  shardings = nnx.to_pure_dict(sharding.state_shardings(nnx.state(model), mesh))
  opt_shardings = optax.tree_map_params(tx, lambda _, s: s, opt, shardings,
                                        transform_non_params=lambda _: NamedSharding(mesh, P()))
  return _chip_bytes(opt, opt_shardings)


# --------------------------------------------------------------------------- drafters


def _eagle3(cfg: TrainConfig, policy: Decoder):
  path = os.path.join(checkpoint.resolve_path(cfg.drafter.options.path), "config.json")
  with open(path) as f:
    head = eagle3.abstract_head(eagle3_io.config_from_json(json.load(f), policy.cfg))
  return proposers.proposer_class("eagle3")(cfg.drafter.options, head, policy)


def _mtp(cfg: TrainConfig, policy: Decoder):
  heads = mtp.abstract_heads(mtp.load_config(checkpoint.resolve_path(cfg.drafter.options.path)))
  return proposers.proposer_class("mtp")(cfg.drafter.options, heads, policy)


def _draft_model(cfg: TrainConfig, policy: Decoder):
  del policy
  draft = model_config(cfg.drafter.options.path, cfg.plan.draft_model, "plan.draft_model")
  return proposers.proposer_class("draft_model")(cfg.drafter.options, abstract_decoder(draft))


# Proposers with weights, built around abstract weights from their configs alone (the
# others build from the policy: `Proposer.build`).
_WITH_WEIGHTS = {"draft_model": _draft_model, "eagle3": _eagle3, "mtp": _mtp}


def _proposer(cfg: TrainConfig, policy: Decoder) -> proposers.Proposer | None:
  """The recipe's proposer with abstract weights (None: plain AR rollouts)."""
  if not cfg.drafter.k_max:
    return None
  build = _WITH_WEIGHTS.get(cfg.drafter.proposer)
  if build is None:
    return proposers.proposer_class(cfg.drafter.proposer).build(cfg.drafter.options, policy)
  try:
    return build(cfg, policy)
  except FileNotFoundError as e:
    raise PlanError(f"drafter.{cfg.drafter.proposer}: {e}") from e


# --------------------------------------------------------------------------- activations


def _ways(spec_entry, mesh_shape: dict[str, int]) -> int:
  axes = () if spec_entry is None else (
      (spec_entry,) if isinstance(spec_entry, str) else spec_entry)
  return math.prod(mesh_shape[a] for a in axes)


def _split(size: int, axis: str, mesh_shape: dict[str, int]) -> int:
  """One chip's share of a dimension of ``size`` with logical name ``axis``."""
  return size // _ways(sharding.logical_to_spec((axis,), (size,), mesh_shape)[0], mesh_shape)


def local_config(cfg: ModelConfig, mesh_shape: dict[str, int]) -> ModelConfig:
  """``cfg`` as one chip computes it: the tensor-split widths (query and KV heads, MLP,
  vocabulary) divided as `sharding.RULES` split the activations."""
  heads = _split(cfg.num_heads, "act_heads", mesh_shape)
  kv = _split(cfg.num_kv_heads, "act_kv_heads", mesh_shape)
  if heads % kv:  # KV heads replicated under split query heads: count attention whole
    heads, kv = cfg.num_heads, cfg.num_kv_heads
  return cfg.replace(num_heads=heads, num_kv_heads=kv,
                     mlp_dim=_split(cfg.mlp_dim, "act_mlp", mesh_shape),
                     vocab_size=_split(cfg.vocab_size, "act_vocab", mesh_shape))


def saved_bytes(f, primal: Any, *consts: Any) -> int:
  """Bytes the backward pass of ``f(primal, *consts)`` keeps from its forward: the
  residuals of its VJP that are not its inputs (``eval_shape``: nothing runs)."""
  saved: dict[int, int] = {}

  def trace(primal, consts):
    out, vjp = jax.vjp(lambda p: f(p, *consts), primal)
    inputs = {id(x) for x in jax.tree.leaves((primal, consts))}
    for r in jax.tree.leaves(vjp):
      if id(r) not in inputs:
        saved[id(r)] = r.size * jnp.dtype(r.dtype).itemsize
    return out

  jax.eval_shape(trace, primal, consts)
  return sum(saved.values())


def _update_saved_bytes(cfg: TrainConfig, policy: ModelConfig, draft: ModelConfig | None,
                        rows: int, T: int) -> int:
  """`saved_bytes` of the learner's loss on one chip's ``rows x T`` of a micro-batch."""
  lc = cfg.learner
  model = abstract_decoder(policy)
  graphdef, trainable = nnx.graphdef(model), (_abstract_state(model), None)
  draft_graphdef, distill = None, None
  if draft is not None:
    draft_model = abstract_decoder(draft)
    draft_graphdef = nnx.graphdef(draft_model)
    trainable = (trainable[0], _abstract_state(draft_model))
    distill = rl_learner.DistillParams(cfg.drafter.train.loss, cfg.drafter.train.loss_weight,
                                       cfg.rollout.temperature)
  ref = trainable[0] if lc.kl_coef > 0 else None
  sds = jax.ShapeDtypeStruct
  mb = {"tokens": sds((rows, T), jnp.int32), "targets": sds((rows, T), jnp.int32),
        "valid": sds((rows, T), jnp.bool_), "adv": sds((rows,), jnp.float32),
        "reward": sds((rows,), jnp.float32),
        **{k: sds((rows, T), jnp.float32)
           for k in ("mask", "old_logp", "weight", "draft_weight")}}
  loss = functools.partial(
      rl_learner._micro_loss, graphdef=graphdef, draft_graphdef=draft_graphdef,
      loss_name=lc.loss, p=losses.LossParams(lc.clip_eps_low, lc.clip_eps_high, lc.kl_coef),
      distill=distill)
  return saved_bytes(lambda t, r, b: loss(t, r, b)[0], trainable, ref, mb)


def update_activation_bytes(cfg: TrainConfig, policy: ModelConfig, draft: ModelConfig | None,
                            mesh_shape: dict[str, int]) -> tuple[int, int, int]:
  """``(bytes, rows, T)``: one chip's activations in the update of its ``rows`` of a
  micro-batch of width ``T``, with the recipe's remat (and, under remat, one layer's
  recomputed intermediates, of the model with the wider layers)."""
  m, T = cfg.learner.micro_batch_size, cfg.rollout.max_prompt_len + cfg.rollout.max_new_tokens
  rows = m // _ways(sharding.logical_to_spec(("batch",), (m,), mesh_shape)[0], mesh_shape)
  remat = cfg.learner.rematerialize
  local = lambda c: local_config(c, mesh_shape).replace(remat=remat)  # noqa: E731
  total = _update_saved_bytes(cfg, local(policy), draft and local(draft), rows, T)
  if remat:
    # One layer's backward runs at a time, so only the wider model's layer counts.
    wide = max((c for c in (policy, draft) if c is not None),
               key=lambda c: (c.embed_dim, c.mlp_dim, c.num_heads * c.head_dim))
    one_layer = lambda n: _update_saved_bytes(  # noqa: E731
        cfg, local(wide).replace(num_layers=n, remat=False), None, rows, T)
    total += one_layer(2) - one_layer(1)
  return total, rows, T


# --------------------------------------------------------------------------- the plan


def _engine_state_bytes(cfg: TrainConfig, policy: Decoder, proposer, mesh: AbstractMesh
                        ) -> tuple[int, int, int]:
  """``(policy KV pool, proposer state, the rest)``: one chip's share of the rollout
  engine's device state, as the engine lays it out."""
  from spec_rl_jax.train import engine_config  # noqa: PLC0415 (train imports this module)
  programs = DevicePrograms(nnx.graphdef(policy), policy.cfg, engine_config(cfg, ()),
                            proposer, mesh, None)
  state, shardings = jax.eval_shape(programs.init_state), programs.state_sharding
  kv = _chip_bytes(state.cache.layers, shardings.cache.layers)
  drafter = _chip_bytes(state.proposer, shardings.proposer)
  return kv, drafter, _chip_bytes(state, shardings) - kv - drafter


def plan(cfg: TrainConfig, capacity: int | None = None, chip: str = "") -> tuple[Plan, ...]:
  """The per-chip plan of ``cfg`` against ``capacity`` bytes: one for the policy's mesh
  (learner and rollout engine), or, with the engine on a sub-mesh of its own
  (``rollout.mesh``), one for the learner's chips and one for the engine's."""
  learner_mesh = abstract_mesh(cfg.policy.mesh)
  engine_mesh = abstract_mesh(cfg.rollout.mesh) if cfg.rollout.mesh else learner_mesh
  policy = abstract_decoder(model_config(cfg.policy.path, cfg.plan.policy_model,
                                         "plan.policy_model"))
  proposer = _proposer(cfg, policy)
  drafter = proposer.model() if proposer is not None else None
  trains = bool(cfg.drafter.train.every) and isinstance(drafter, Decoder)
  p = _weights_bytes(policy, learner_mesh)
  learner = [("policy params", p),
             ("policy Adam moments",
              _optimizer_bytes(rl_learner.make_optimizer(cfg.learner), policy, learner_mesh)),
             ("policy gradients", p)]
  if cfg.learner.kl_coef > 0:
    learner.append(("reference policy (learner.kl_coef > 0)", p))
  engine = [("policy weights, rollout engine's copy", _weights_bytes(policy, engine_mesh))]
  kv, proposer_state, slots = _engine_state_bytes(cfg, policy, proposer, engine_mesh)
  engine.append(("policy KV pool", kv))
  if drafter is not None:
    engine.append(("drafter weights, rollout engine's copy",
                   _weights_bytes(drafter, engine_mesh)))
    d = _weights_bytes(drafter, learner_mesh)
    learner.append(("drafter weights, the proposer's", d))
    if trains:
      learner += [("drafter params", d),
                  ("drafter Adam moments", _optimizer_bytes(
                      rl_learner.make_optimizer(cfg.drafter.train), drafter, learner_mesh)),
                  ("drafter gradients", d)]
  if proposer_state:
    engine.append((f"drafter state ({cfg.drafter.proposer}: KV pool, rows)", proposer_state))
  engine.append(("rollout slots (tokens, logprobs, history)", slots))
  act, m, T = update_activation_bytes(cfg, policy.cfg, drafter.cfg if trains else None,
                                      dict(learner_mesh.shape))
  learner.append((f"update activations ({m} x {T} tokens,"
                  f" remat {'on' if cfg.learner.rematerialize else 'off'})", act))
  on = lambda mesh, rows, role: Plan(tuple(dict(mesh.shape).items()), tuple(rows),  # noqa: E731
                                     capacity, chip, role)
  if engine_mesh is learner_mesh:
    return (on(learner_mesh, learner + engine, ""),)
  return (on(learner_mesh, learner, "learner, policy.mesh"),
          on(engine_mesh, engine, "rollout engine, rollout.mesh"))


def chip_spec(name: str) -> Chip:
  if name not in CHIPS:
    raise PlanError(f"unknown chip {name!r}; known: {', '.join(sorted(CHIPS))}")
  return CHIPS[name]


def device_memory() -> int | None:
  """The bytes the runtime lets JAX allocate on this process's first device (None:
  not reported, e.g. on CPU)."""
  stats = jax.local_devices()[0].memory_stats()
  return stats.get("bytes_limit") if stats else None


def check(cfg: TrainConfig) -> tuple[Plan, ...]:
  """The trainer's check, before it allocates: the plans against the memory the devices
  report, else against the recipe's ``plan.chip``; raises `PlanError` with the numbers
  of a plan that does not fit. Neither known (CPU without ``plan.chip``): no plan."""
  limit = device_memory()
  if limit is not None:
    plans = plan(cfg, limit, f"{jax.local_devices()[0].device_kind}, as its runtime reports")
  elif cfg.plan.chip:
    chip = chip_spec(cfg.plan.chip)
    plans = plan(cfg, chip.usable, chip.label)
  else:
    return ()
  for p in plans:
    if not p.fits:
      raise PlanError(p.error())
  return plans


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--config", default=None, help="a YAML recipe (configs/*.yaml)")
  parser.add_argument("--chip", default=None, choices=sorted(CHIPS),
                      help="the accelerator (default: the recipe's plan.chip)")
  parser.add_argument("overrides", nargs="*", help="section.field=value")
  args = parser.parse_args(argv)
  cfg = load_config(args.config, args.overrides)
  name = args.chip or cfg.plan.chip
  try:
    chip = chip_spec(name) if name else None
    plans = plan(cfg, chip and chip.usable, chip.label if chip else "chip not named")
  except PlanError as e:
    print(f"plan: {e}", file=sys.stderr)
    return 2
  print("\n\n".join(p.table() for p in plans))
  for p in plans:
    if not p.fits:
      print(p.error().split("\n")[0], file=sys.stderr)
  return 0 if all(p.fits for p in plans) else 1


if __name__ == "__main__":
  sys.exit(main())
