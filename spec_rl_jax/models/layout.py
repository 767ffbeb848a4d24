"""Backend-specific inference layout and compiler options, in one place.

An `InferenceLayout` turns a `Decoder` into the `transformer.Weights` that inference
programs (prefill, decode rounds, drafting) read, and names the XLA compiler options
those programs compile with. `for_backend` picks one when a rollout engine is built;
model, proposer and learner code never branch on the backend.

  `StackedLayout`    the stacked ``[L, ...]`` layer weights, run as a scan: TPU and GPU
                     read a scan's slice in place, and compile time stays independent
                     of depth.
  `CpuLayerCopies`   per-layer copies of the layer weights, run as an unrolled loop:
                     XLA:CPU copies a layer's weights out of the stacked arrays before
                     each matmul (a scan's dynamic slice, or an unrolled loop's static
                     slice), which makes decoding much slower than separate per-layer
                     buffers. From `INPUT_MAJOR_MIN_ROWS` matmul rows the projections
                     are copied input-major (models/layers.py `project`).

Every layout copies: the weights it returns never alias the model's arrays, so a
learner may donate its buffers after handing weights to an engine.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from spec_rl_jax import sharding
from spec_rl_jax.models.transformer import Decoder, Weights

# Matmul rows from which the CPU per-layer projections are copied input-major: on the
# bench model 1 row ran faster output-major and 2 or more rows input-major.
INPUT_MAJOR_MIN_ROWS = 2

# XLA:CPU, training programs (forward + backward): YNNPACK runs the elementwise fusions
# too, which XLA's loop emitter runs much slower in the MLP's backward.
_CPU_TRAINING_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type":
                         "LIBRARY_FUSION_TYPE_DOT,LIBRARY_FUSION_TYPE_ELTWISE"}
# XLA:CPU, training programs: positions per forward + backward. Past a few thousand
# positions a layer's activations ([positions, mlp_dim] fp32) leave the caches and the
# elementwise work between the dots runs at memory speed, so long micro-batches run
# faster as scanned chunks of rows. Accelerators keep whole micro-batches (bigger
# matmuls).
_TRAINING_FORWARD_TOKENS = {"cpu": 2048}
# XLA:CPU, forward-only programs: YNNPACK runs each dot on its own; handing it whole
# subgraphs (dots with the elementwise ops between them) runs much slower once a dot
# has more than a few rows.
_CPU_INFERENCE_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type":
                          "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"}


class StackedLayout:
  """The accelerator layout: stacked layer weights, scanned."""

  name = "stacked"
  compiler_options: dict[str, str] | None = None

  def weights(self, model: Decoder, rows: int, mesh: Mesh | None = None) -> Weights:
    """``model``'s weights for programs whose matmuls have ``rows`` rows, on ``mesh``."""
    del rows
    return Weights(sharding.copy_state(nnx.state(model), mesh), None)


class CpuLayerCopies(StackedLayout):
  """The XLA:CPU layout: per-layer weight copies, input-major from 2 matmul rows."""

  name = "cpu_layer_copies"
  compiler_options = _CPU_INFERENCE_OPTIONS

  def weights(self, model: Decoder, rows: int, mesh: Mesh | None = None) -> Weights:
    if not isinstance(model, Decoder):  # draft heads: one layer (or a few), not scanned
      return super().weights(model, rows, mesh)
    state = sharding.copy_state(nnx.state(model), mesh)
    _, stacked = nnx.split(nnx.merge(nnx.graphdef(model), state).layers)
    input_major = rows >= INPUT_MAJOR_MIN_ROWS

    def copy(var: nnx.Variable, i: int) -> nnx.Variable:
      value, axes = var[...][i], var.axes[1:]
      n_in = var.get_metadata().get("in_dims")
      if not input_major or n_in is None:
        return var.replace(value, axes=axes)
      order = tuple(range(value.ndim - n_in, value.ndim)) + tuple(range(value.ndim - n_in))
      return var.replace(jnp.transpose(value, order), axes=tuple(axes[a] for a in order),
                         input_major=True)

    is_var = lambda x: isinstance(x, nnx.Variable)
    layers = tuple(jax.tree.map(lambda v, i=i: copy(v, i), stacked, is_leaf=is_var)
                   for i in range(model.cfg.num_layers))
    return Weights(state, layers)


LAYOUTS = {"stacked": StackedLayout, "cpu_layer_copies": CpuLayerCopies}


def for_backend(backend: str | None = None) -> StackedLayout:
  """The inference layout of ``backend`` (default: JAX's default backend)."""
  backend = jax.default_backend() if backend is None else backend
  return CpuLayerCopies() if backend == "cpu" else StackedLayout()


def training_compiler_options(backend: str | None = None) -> dict[str, str] | None:
  """``compiler_options`` for jitted training steps on ``backend``."""
  backend = jax.default_backend() if backend is None else backend
  return dict(_CPU_TRAINING_OPTIONS) if backend == "cpu" else None


def training_forward_tokens(backend: str | None = None) -> int | None:
  """Positions per device a training forward + backward should cover on ``backend``
  (``None``: no limit, the whole micro-batch at once)."""
  backend = jax.default_backend() if backend is None else backend
  return _TRAINING_FORWARD_TOKENS.get(backend)


def chunk_rows(m: int, width: int, tokens: int | None, devices: int) -> int:
  """Rows per forward + backward of a micro-batch ``[m, width]``: the most whose
  positions per device stay within ``tokens`` (``None``: all ``m``), a divisor of ``m``
  and, where ``m`` splits over the ``devices`` of the mesh's batch axes, a multiple of
  them (each device keeps a share of every chunk); at least the smallest such.

  Chunks are consecutive rows of one micro-batch at its width, so they add no compiled
  widths and no padding.
  """
  if tokens is None:
    return m
  split = devices if m % devices == 0 else 1
  options = [c for c in range(split, m + 1, split) if m % c == 0]
  return max((c for c in options if c * width <= tokens * split), default=options[0])
