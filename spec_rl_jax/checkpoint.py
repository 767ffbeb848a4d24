"""Training checkpoints (orbax) and loading a model from any checkpoint directory.

A run directory holds ``tokenizer/`` (HF layout, written when the run starts) and
``ckpt/<step>/`` with three orbax items:

  * ``state``: ``{"params", "opt", "step"}`` — pure pytrees of arrays (an RL run adds
    ``"draft"``, the draft model's weights, ``"draft_opt"`` when it trains the drafter,
    and ``"counters"``),
  * ``data``: the grain iterator state (the exact future batches),
  * ``meta``: JSON — the run config, the model config and the rollout engine's memory
    of earlier rollouts per prompt (the ngram proposer's references); an RL run with a
    draft model adds its model config as ``draft_model``,

so a killed run resumes with the same future (params, optimizer, data, step; the
trainer's randomness is a function of the step). `load_model` opens either a run
directory (latest step) or a Hugging Face directory (``config.json``), so a run directory
is a valid ``policy.path``; ``python -m spec_rl_jax.export`` turns one into a HF
checkpoint.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import grain
import jax
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh

from spec_rl_jax import sharding
from spec_rl_jax.models import attention, hf_io
from spec_rl_jax.models.config import Llama3RopeScaling, ModelConfig
from spec_rl_jax.models.tokenizer import Tokenizer
from spec_rl_jax.models.transformer import Decoder, abstract_decoder

CKPT_DIR = "ckpt"
TOKENIZER_DIR = "tokenizer"


def cache_dir() -> str:
  """Where the default models live: ``$SPEC_RL_JAX_CACHE``, else ``~/.cache/spec_rl_jax``."""
  return os.path.expanduser(os.environ.get("SPEC_RL_JAX_CACHE", "~/.cache/spec_rl_jax"))


def resolve_path(path: str) -> str:
  """Absolute paths as given; relative ones under the cache (the default models)."""
  return path if os.path.isabs(path) else os.path.join(cache_dir(), path)


def config_to_json(cfg: ModelConfig) -> dict:
  return dataclasses.asdict(cfg)


def config_from_json(d: dict) -> ModelConfig:
  scaling = d.get("rope_scaling")
  return ModelConfig(**{**d, "rope_scaling": scaling and Llama3RopeScaling(**scaling)})


class TrainCheckpointer:
  """Saves/restores ``(state, data iterator, meta)`` under ``run_dir/ckpt``."""

  def __init__(self, run_dir: str, max_to_keep: int = 2):
    self.manager = ocp.CheckpointManager(
        os.path.join(os.path.abspath(run_dir), CKPT_DIR),
        options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True))

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, state: Any, data_iter, meta: dict) -> None:
    """Asynchronous for the arrays; `wait` (or `close`) before reading it back."""
    self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), data=grain.checkpoint.CheckpointSave(data_iter),
        meta=ocp.args.JsonSave(meta)))

  def restore(self, abstract_state: Any, data_iter) -> tuple[Any, dict]:
    """Restores the latest step into ``data_iter``; returns ``(state, meta)``."""
    step = self.manager.latest_step()
    out = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state),
        data=grain.checkpoint.CheckpointRestore(data_iter), meta=ocp.args.JsonRestore()))
    return out.state, out.meta

  def all_steps(self) -> list[int]:
    return sorted(self.manager.all_steps())

  def restore_meta(self, step: int | None = None) -> dict:
    """The ``meta`` item of ``step`` (None: the latest)."""
    step = self.manager.latest_step() if step is None else step
    return self.manager.restore(step, args=ocp.args.Composite(
        meta=ocp.args.JsonRestore())).meta

  def restore_params(self, abstract_params: Any, step: int | None = None,
                     key: str = "params") -> Any:
    """Only ``state[key]`` of ``step`` (None: the latest), e.g. to evaluate a running
    job; ``key="draft"``: an RL run's draft model weights."""
    step = self.manager.latest_step() if step is None else step
    abstract = {key: abstract_params}
    state = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.PyTreeRestore(
            item=abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract),
            partial_restore=True)))
    return state.state[key]

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.close()


def abstract_params(cfg: ModelConfig, mesh: Mesh | None = None) -> tuple[Any, dict]:
  """``(graphdef, pure-dict params of ShapeDtypeStructs)`` of a decoder; with ``mesh``,
  laid out on it by the logical rules (a restore then reads only each process's
  shards)."""
  graphdef, state = nnx.split(abstract_decoder(cfg))
  if mesh is None:
    return graphdef, jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype),
                                  nnx.to_pure_dict(state))
  shardings = nnx.to_pure_dict(sharding.state_shardings(state, mesh))
  return graphdef, jax.tree.map(lambda v, s: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s),
                                nnx.to_pure_dict(state), shardings)


def restore_decoder(ckpt: TrainCheckpointer, cfg: ModelConfig, step: int | None = None,
                    key: str = "params", mesh: Mesh | None = None) -> Decoder:
  """The `Decoder` of config ``cfg`` whose weights are ``state[key]`` at ``step`` (on
  ``mesh`` when given)."""
  graphdef, abstract = abstract_params(cfg, mesh)
  return nnx.merge(graphdef, ckpt.restore_params(abstract, step, key))


def run_tokenizer(path: str) -> Tokenizer | None:
  """The tokenizer a run directory saved (None: a run from before runs saved it)."""
  tok_dir = os.path.join(path, TOKENIZER_DIR)
  return Tokenizer.load(tok_dir) if os.path.isdir(tok_dir) else None


def _load_run(path: str, mesh: Mesh | None) -> tuple[Decoder, Tokenizer | None]:
  ckpt = TrainCheckpointer(path)
  if ckpt.latest_step() is None:
    raise FileNotFoundError(f"{path}: run directory without checkpoints")
  meta = ckpt.restore_meta()
  if "model" not in meta:
    ckpt.close()
    raise ValueError(f"{path} holds {meta['draft_head']['kind']} draft heads, not a model:"
                     " export them (python -m spec_rl_jax.export) and name that directory"
                     " in the proposer's path")
  model = restore_decoder(ckpt, config_from_json(meta["model"]), mesh=mesh)
  ckpt.close()
  return model, run_tokenizer(path)


def _load_hf(path: str, mesh: Mesh | None) -> tuple[Decoder, Tokenizer | None]:
  # A draft model or teacher may come without a tokenizer; callers that need one check.
  has_tokenizer = os.path.exists(os.path.join(path, hf_io.TOKENIZER_FILE))
  return hf_io.load_hf_checkpoint(path, mesh, load_tokenizer=has_tokenizer)


# (marker file or directory inside the checkpoint, loader), tried in order.
_LOADERS = (("config.json", _load_hf), (CKPT_DIR, _load_run))


def load_model(path: str, attention_impl: str = "auto",
               mesh: Mesh | None = None) -> tuple[Decoder, Tokenizer | None]:
  """A model (and tokenizer, if stored) from a HF directory or a training run, running
  ``attention_impl`` (`attention.resolve_impl`, checked before any weight is read):
  the attention kernels are a choice of the machine that runs the model, not of the
  checkpoint (a run saves the implementation it trained with). With ``mesh`` the
  weights load straight onto it, each process reading only its devices' shards (a
  multi-host run); without, onto one device."""
  impl = attention.resolve_impl(attention_impl)
  for marker, loader in _LOADERS:
    if os.path.exists(os.path.join(path, marker)):
      model, tokenizer = loader(path, mesh)
      model.cfg = model.cfg.replace(attention_impl=impl)
      return model, tokenizer
  raise FileNotFoundError(f"{path}: neither a HF checkpoint (config.json) nor a training"
                          f" run ({CKPT_DIR}/)")
