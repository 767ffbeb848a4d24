"""Logical axis names → mesh axes.

Every parameter carries a tuple of logical axis names in its ``axes`` metadata and
activations are annotated with `shard` at a few points in the model. One table,
`RULES`, maps logical names to the mesh axes ``data``, ``fsdp`` and ``tensor``;
nothing else in the code base knows about mesh axes.

A dimension whose size is not divisible by the product of the mesh axes it maps to is
replicated instead (e.g. 8 KV heads on a 16-way ``tensor`` axis), so every preset runs
on every mesh.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")

# logical name → mesh axis (or tuple of axes, or None for replicated).
RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    # parameters
    ("layers", None),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("norm", None),
    # activations
    ("batch", ("data", "fsdp")),
    ("seq", None),
    ("act_embed", None),
    ("act_mlp", "tensor"),
    ("act_heads", "tensor"),
    ("act_kv_heads", "tensor"),
    ("act_vocab", "tensor"),
)


def make_mesh(shape: Sequence[int] = (1, 1, 1), devices=None) -> Mesh:
  """A ``(data, fsdp, tensor)`` mesh over the first ``prod(shape)`` devices."""
  devices = jax.devices() if devices is None else devices
  n = int(np.prod(shape))
  if n > len(devices):
    raise ValueError(f"mesh {tuple(shape)} needs {n} devices, only {len(devices)} present")
  return Mesh(np.asarray(devices[:n]).reshape(tuple(shape)), MESH_AXES)


def placement(policy_shape: Sequence[int], rollout_shape: Sequence[int] = (),
              rollout_first_device: int | None = None, devices=None) -> tuple[Mesh, Mesh]:
  """``(policy mesh, rollout mesh)``: the learner's mesh over the first devices and the
  rollout engine's.

  An empty ``rollout_shape`` shares the policy's mesh (rollouts and updates interleave
  on the same devices); otherwise the rollout mesh is a disjoint sub-mesh starting at
  ``rollout_first_device`` (default: right after the policy's devices), and weights
  are copied across after every update.
  """
  devices = jax.devices() if devices is None else devices
  policy = make_mesh(policy_shape, devices)
  if not rollout_shape:
    return policy, policy
  n_p, n_r = int(np.prod(policy_shape)), int(np.prod(rollout_shape))
  first = n_p if rollout_first_device is None else rollout_first_device
  if first < n_p:
    raise ValueError(f"rollout.mesh {tuple(rollout_shape)} from device {first} overlaps"
                     f" policy.mesh {tuple(policy_shape)} (devices 0..{n_p - 1}): the"
                     f" rollout sub-mesh must start at device {n_p} or later")
  if first + n_r > len(devices):
    raise ValueError(f"policy.mesh {tuple(policy_shape)} (devices 0..{n_p - 1}) and"
                     f" rollout.mesh {tuple(rollout_shape)} (devices {first}.."
                     f"{first + n_r - 1}) need {first + n_r} devices, only"
                     f" {len(devices)} present")
  return policy, make_mesh(rollout_shape, devices[first:first + n_r])


def logical_to_spec(axes: Sequence[str | None], shape: Sequence[int],
                    mesh_shape: dict[str, int], rules=RULES) -> P:
  """Maps logical axis names of an array of ``shape`` to a mesh ``PartitionSpec``."""
  table = dict(rules)
  if len(axes) != len(shape):
    raise ValueError(f"logical axes {tuple(axes)} do not match rank of shape {tuple(shape)}")
  used: set[str] = set()
  spec = []
  for name, size in zip(axes, shape):
    if name is None:
      spec.append(None)
      continue
    if name not in table:
      raise KeyError(f"logical axis {name!r} has no rule; known: {sorted(table)}")
    target = table[name]
    mesh_axes = () if target is None else ((target,) if isinstance(target, str) else target)
    mesh_axes = tuple(a for a in mesh_axes if mesh_shape.get(a, 1) > 1 and a not in used)
    ways = int(np.prod([mesh_shape[a] for a in mesh_axes])) if mesh_axes else 1
    if not mesh_axes or size % ways:
      spec.append(None)
      continue
    used.update(mesh_axes)
    spec.append(mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
  return P(*spec)


def _mesh_shape(mesh) -> dict[str, int]:
  return dict(zip(mesh.axis_names, mesh.axis_sizes))


def state_shardings(state: nnx.State, mesh: Mesh, rules=RULES) -> nnx.State:
  """``NamedSharding`` for every variable of ``state`` from its ``axes`` metadata."""
  shape = _mesh_shape(mesh)

  def one(var):
    value = var.get_value() if isinstance(var, nnx.Variable) else var
    axes = var.get_metadata().get("axes") if isinstance(var, nnx.Variable) else None
    if axes is None:
      axes = (None,) * len(value.shape)
    return NamedSharding(mesh, logical_to_spec(axes, value.shape, shape, rules))

  return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def shard(x: jax.Array, axes: Sequence[str | None], rules=RULES) -> jax.Array:
  """Constrains activation ``x`` to its logical sharding; a no-op without a mesh."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or all(s == 1 for s in mesh.axis_sizes):
    return x
  return jax.lax.with_sharding_constraint(
      x, logical_to_spec(axes, x.shape, _mesh_shape(mesh), rules))


def spec_table(state: nnx.State, mesh: Mesh, rules=RULES) -> dict[str, P]:
  """``{"path.to.param": PartitionSpec}`` — for logging and golden tests."""
  shardings = state_shardings(state, mesh, rules)
  return {".".join(map(str, path)): s.spec
          for path, s in nnx.to_flat_state(shardings)}


def device_put_state(state: Any, mesh: Mesh, rules=RULES):
  """Places a host/device state on ``mesh`` according to its logical axes."""
  return jax.device_put(state, state_shardings(state, mesh, rules))


def copy_state(state: Any, mesh: Mesh | None, rules=RULES):
  """``state`` copied (never aliased: the owner may donate its buffers), on ``mesh`` by
  its logical axes (None: on the devices it is on)."""
  if mesh is None:
    return jax.tree.map(lambda x: jax.device_put(x, x.sharding, may_alias=False), state)
  return jax.device_put(state, state_shardings(state, mesh, rules), may_alias=False)


def mesh_of(tree) -> Mesh | None:
  """The mesh of a pytree's arrays (``None`` when they sit on one device unsharded)."""
  for leaf in jax.tree.leaves(tree):
    s = getattr(leaf, "sharding", None)
    if isinstance(s, NamedSharding) and s.mesh.size > 1:
      return s.mesh
  return None
