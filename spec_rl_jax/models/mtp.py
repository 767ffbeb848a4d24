"""Multi-token prediction heads shaped as DeepSeek-V3's MTP modules (DeepSeek-AI,
"DeepSeek-V3 Technical Report", 2024, §2.2), drafting from the policy's own features.

The paper's module ``k`` (``k = 1..D``) at index ``i`` combines the representation of
the depth before, ``h^{k-1}_i`` (``h^0``: the main model's), with the embedding of the
token ``k`` places later and predicts the token after it:

  h'^k_i = M_k [RMSNorm(h^{k-1}_i); RMSNorm(Emb(t_{i+k}))],   h^k = TRM_k(h'^k),
  P^k_{i+k+1} = OutHead(h^k_i).

Indexed here by the position ``j = i + k`` of the token the module reads (where its KV
cache entry lives), with ``d`` for the module (``d = 1..D_m``):

  h'^d_j = eh_proj_d([enorm_d(e_j); hnorm_d(h^{d-1}_{j-1})])   e_j: the policy's Emb(t_j)
  h^d_j  = Block_d(h'^d_{<=j})        causal attention over the module's own keys
  logits^d_j = policy_head(head_norm_d(h^d_j))   predicts t_{j+1}

``h^0_j`` is the output of the policy's last layer at ``j`` (before its final norm:
``hidden_layers = (L-1,)``), and ``h^{d-1}_{-1} = 0`` (position 0 has no previous
feature). Every module predicts the same next token ``t_{j+1}`` as the policy at ``j``,
from the tokens up to ``j`` and a feature ``d`` positions staler than the policy's own
(``h^d_j`` depends on ``h^0_{j-d}``). A drafter that knows the policy's features up to
``ℓ - 1`` and the token at ``ℓ`` thus drafts ``t_{ℓ+d}`` with module ``d`` at position
``ℓ + d - 1`` (spec/proposers/mtp.py). The output head and the input embedding are
the policy's (DeepSeek's ``shared_head.head`` and ``embed_tokens``: shared weights).

Layout: the ``D_m`` modules are stacked with a leading ``[D_m]`` axis (``layers``
metadata) and scanned like the decoder's layers; each module's `Block` has the policy's
shape (attention with q/k norms when the policy has them). In a KV cache the modules
are the "layers" of one pool: module ``d`` is layer ``d - 1``.

Checkpoint (`save_mtp` / `load_mtp`): ``mtp.safetensors`` with DeepSeek-V3's names,
the modules numbered as extra layers after the policy's ``L``: module ``d`` is
``model.layers.{L+d-1}.{enorm,hnorm,eh_proj,shared_head.norm}.weight`` plus the block's
Llama / Qwen3 tensor names (models/hf_io.py), and ``mtp_config.json``: the policy's HF
``config.json`` with ``num_nextn_predict_layers = D_m`` and ``policy_fingerprint``, as
DeepSeek-V3 publishes its MTP module and vLLM reads it. DeepSeek's checkpoints also carry
per-module copies of the shared ``embed_tokens`` and ``shared_head.head``, which are not
written (the policy's are read).

Shape legend: ``B`` batch (slots), ``T`` tokens, ``D`` embed dim, ``V`` vocab, ``D_m``
modules, ``L`` policy layers.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from spec_rl_jax.models import attention, hf_io
from spec_rl_jax.models.config import ModelConfig
from spec_rl_jax.models.eagle3 import check_made_for
from spec_rl_jax.models.layers import Block, RMSNorm, _param, project, rope_inv_freq
from spec_rl_jax.rl import losses

WEIGHTS_FILE = "mtp.safetensors"
CONFIG_FILE = "mtp_config.json"


@dataclasses.dataclass(frozen=True)
class MTPConfig:
  """``num_modules`` (``D_m``) modules for the policy ``policy`` (its `ModelConfig`:
  each module's block has its shape); ``policy_fingerprint``: `eagle3.policy_fingerprint`
  of the policy the heads were trained for, ``""`` when unknown."""

  num_modules: int
  policy: ModelConfig
  policy_fingerprint: str = ""

  def __post_init__(self):
    if self.num_modules < 1:
      raise ValueError(f"num_modules must be >= 1, got {self.num_modules}")

  @property
  def hidden_layers(self) -> tuple[int, ...]:
    """The policy layer whose output is ``h^0``: the last."""
    return (self.policy.num_layers - 1,)

  def pool_config(self) -> ModelConfig:
    """The modules as the layers of one KV pool (`PagedKVCache.init`)."""
    return self.policy.replace(num_layers=self.num_modules)

  def check_policy(self, policy: ModelConfig, fingerprint: str | None = None) -> None:
    """Raises unless these heads were made for ``policy`` (and, when both are known, the
    policy with ``fingerprint``)."""
    # The modules' rows and scan carries hold the policy's hidden states: one dtype.
    check_made_for("the MTP heads", "heads",
                   {"hidden size": (self.policy.embed_dim, policy.embed_dim),
                    "layer count": (self.policy.num_layers, policy.num_layers),
                    "vocabulary": (self.policy.vocab_size, policy.vocab_size),
                    "dtype": (self.policy.param_dtype, policy.param_dtype)},
                   self.policy_fingerprint, fingerprint)


class PolicyTables(NamedTuple):
  """What the heads read of the policy: its token embedding and its LM head (``[V, D]``
  each; the same table when the policy ties them)."""

  embed: jax.Array
  head: jax.Array


def policy_tables(graphdef: nnx.GraphDef, state: Any) -> PolicyTables:
  """The tables of the policy ``(graphdef, state)`` (``state``: `nnx.state` of a
  `Decoder`, or ``transformer.Weights.state``); traceable."""
  policy = nnx.merge(graphdef, state)
  embed = policy.embed[...]
  return PolicyTables(embed, embed if policy.lm_head is None else policy.lm_head[...])


class MTPModule(nnx.Module):
  """Module ``d``'s weights (one per ``stack`` entry): ``enorm``, ``hnorm``, ``eh_proj``
  ``[D, 2D]`` (output-major), a `Block` and ``head_norm`` (``shared_head.norm``)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, stack=()):
    D, dt = cfg.embed_dim, cfg.dtype
    self.enorm = RMSNorm(D, cfg.norm_eps, stack=stack, dtype=dt)
    self.hnorm = RMSNorm(D, cfg.norm_eps, stack=stack, dtype=dt)
    self.eh_proj = _param(rngs, stack, (D, 2 * D), ("embed", None), dt, in_dims=1)
    self.block = Block(cfg, rngs=rngs, stack=stack)
    self.head_norm = RMSNorm(D, cfg.norm_eps, stack=stack, dtype=dt)

  def __call__(self, e, g, positions, inv_freq, attend):
    """``h^d [B,T,D]`` of embeddings ``e`` and previous features ``g`` (``[B,T,D]``:
    ``h^{d-1}`` one position back) → ``(h^d, cache layers)``."""
    x = project(jnp.concatenate([self.enorm(e), self.hnorm(g)], -1), self.eh_proj)
    return self.block(x, positions, inv_freq, attend)


class MTPHeads(nnx.Module):
  """``D_m`` stacked `MTPModule`s (``layers``)."""

  def __init__(self, cfg: MTPConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.layers = MTPModule(cfg.policy, rngs=rngs, stack=(cfg.num_modules,))

  def _run(self, params, d, e, g, positions, cache, cache_layers):
    """Module ``d`` (0-based, its weights ``params``) with the attention context
    ``cache`` over ``cache_layers`` → ``(h [B,T,D], cache layers)``."""
    impl = attention.get_impl(self.cfg.policy.attention_impl)
    attend = lambda q, k, v: cache.attend(impl, cache_layers, d, q, k, v, positions)
    module = nnx.merge(nnx.graphdef(self.layers), params)
    return module(e, g.astype(e.dtype), positions, rope_inv_freq(self.cfg.policy), attend)

  def chain(self, e: jax.Array, h0: jax.Array, first: jax.Array, positions: jax.Array,
            cache: Any) -> tuple[jax.Array, Any]:
    """Modules ``1..D_m`` in turn over one window of ``T`` contiguous positions.

    Args:
      e: ``[B, T, D]`` the policy's embeddings of the window's tokens.
      h0: ``[B, T, D]`` ``h^0`` at the window's positions (only the first ``T - 1``
        are read: module 1 at column ``c`` reads column ``c - 1``).
      first: ``[D_m, B, D]`` ``h^{d-1}`` at the position before the window (what
        module ``d`` reads at column 0).
      positions: ``[B, T]`` (right-aligned, negative = padding; a feature read at
        position 0 is zero).
      cache: attention context whose layers are the modules.
    Returns:
      ``(h, cache)``: ``h [D_m, B, T, D]``, every module's outputs ``h^d``.
    """
    at_zero = (positions == 0)[..., None]
    _, stacked = nnx.split(self.layers)

    def body(carry, xs):
      prev, layers, d = carry
      params, before = xs
      g = jnp.concatenate([before[:, None].astype(prev.dtype), prev[:, :-1]], 1)
      h, layers = self._run(params, d, e, jnp.where(at_zero, 0, g), positions, cache, layers)
      return (h, layers, d + 1), h

    (_, layers, _), h = jax.lax.scan(body, (h0.astype(e.dtype), cache.layers, jnp.int32(0)),
                                     (stacked, first))
    return h, cache.replace(layers=layers)

  def module(self, d: int, e: jax.Array, g: jax.Array, positions: jax.Array, cache: Any
             ) -> tuple[jax.Array, Any]:
    """Module ``d`` (0-based, static) alone: ``h [B,T,D]`` of ``e, g [B,T,D]`` (``g``
    already shifted: the features each position reads) → ``(h, cache)``."""
    _, stacked = nnx.split(self.layers)
    params = jax.tree.map(lambda x: x[d], stacked)
    h, layers = self._run(params, d, e, g, positions, cache, cache.layers)
    return h, cache.replace(layers=layers)

  def logits(self, h: jax.Array, head: jax.Array, d: int | None = None) -> jax.Array:
    """fp32 logits ``[..., V]`` of ``h`` through ``head_norm`` and the policy's LM head
    ``head [V, D]``: of module ``d`` (0-based) for ``h [..., D]``, or of every module
    for ``h [D_m, ..., D]`` (``d = None``)."""
    graphdef, stacked = nnx.split(self.layers)
    norm = lambda p, x: nnx.merge(graphdef, p).head_norm(x)
    x = (jax.vmap(norm)(stacked, h) if d is None
         else norm(jax.tree.map(lambda v: v[d], stacked), h))
    return jnp.einsum("...d,vd->...v", x, head, preferred_element_type=jnp.float32)


def init_heads(cfg: MTPConfig, seed: int = 0) -> MTPHeads:
  return MTPHeads(cfg, rngs=nnx.Rngs(seed))


def abstract_heads(cfg: MTPConfig) -> MTPHeads:
  return nnx.eval_shape(lambda: MTPHeads(cfg, rngs=nnx.Rngs(0)))


# --------------------------------------------------------------------------- training


def forward(heads: MTPHeads, tables: PolicyTables, tokens: jax.Array, h0: jax.Array,
            valid: jax.Array) -> jax.Array:
  """Teacher-forced logits ``[D_m, B, T, V]`` of right-padded ``tokens [B, T]``
  (``valid [B, T]``) at positions ``0..T-1`` with the policy's ``h0 [B, T, D]`` (its
  last layer's outputs, `transformer.teacher_forced` with ``hidden_layers=(L-1,)``):
  module ``d``'s features are module ``d-1``'s outputs one position back."""
  B, T = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(T), (B, T))
  e = jnp.take(tables.embed, tokens, axis=0)
  first = jnp.zeros((heads.cfg.num_modules, B, e.shape[-1]), e.dtype)
  h, _ = heads.chain(e, h0, first, positions, attention.NoCache(valid=valid))
  return heads.logits(h, tables.head)


def distill_loss(logits: jax.Array, teacher: jax.Array, weight: jax.Array
                 ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Forward KL(teacher || module ``d``) of ``logits [D_m, B, T, V]`` against the
  policy's ``teacher [B, T, V]`` (both at position ``j``: distributions of ``t_{j+1}``),
  averaged over modules and summed over positions weighted by ``weight [B, T]``.

  ``weight`` sums to 1 over the batch the loss averages: the response-token mask over
  its count (SFT), or the learner's per-token drafter weights, normalised over a
  mini-batch so that its micro-batches' losses add up to the mini-batch's.

  Returns ``(loss, metrics)``: ``kl [D_m]`` and ``accuracy [D_m]`` (each module's
  argmax against the teacher's) per module, weighted alike."""
  kl = losses.distill_loss("forward_kl", logits, teacher[None])  # [D_m, B, T]
  w = weight.astype(jnp.float32)
  per_module = (kl * w).sum((1, 2))
  hit = jnp.argmax(logits, -1) == jnp.argmax(teacher, -1)[None]
  accuracy = (hit * w).sum((1, 2))
  return per_module.mean(), {"kl": per_module, "accuracy": accuracy}


# --------------------------------------------------------------------------- checkpoint


def _hf_tensors(cfg: MTPConfig) -> dict[tuple[str, ...], hf_io._Tensor]:
  """Our flat state path → DeepSeek-V3 tensor name (``{i}``: the module's layer id)."""
  pre = "model.layers.{i}."
  block = {("layers", "block", *path[1:]): t
           for path, t in hf_io._mapping(cfg.policy).items() if t.per_layer}
  return {("layers", "enorm", "scale"): hf_io._same(pre + "enorm.weight"),
          ("layers", "hnorm", "scale"): hf_io._same(pre + "hnorm.weight"),
          ("layers", "eh_proj"): hf_io._same(pre + "eh_proj.weight"),
          ("layers", "head_norm", "scale"): hf_io._same(pre + "shared_head.norm.weight"),
          **block}


def _layer_ids(cfg: MTPConfig) -> range:
  L = cfg.policy.num_layers
  return range(L, L + cfg.num_modules)


def save_mtp(heads: MTPHeads, directory: str) -> None:
  """Writes ``mtp.safetensors`` and ``mtp_config.json`` (see the module docstring)."""
  cfg = heads.cfg
  flat = dict(nnx.to_flat_state(nnx.state(heads, nnx.Param)))
  tensors = {}
  for path, t in _hf_tensors(cfg).items():
    value = np.asarray(jax.device_get(flat[path].get_value()))
    for d, i in enumerate(_layer_ids(cfg)):
      tensors[t.hf_name.format(i=i)] = np.ascontiguousarray(t.to_hf(value[d]))
  os.makedirs(directory, exist_ok=True)
  save_file(tensors, os.path.join(directory, WEIGHTS_FILE), metadata={"format": "pt"})
  hf = {**hf_io.config_to_hf(cfg.policy), "num_nextn_predict_layers": cfg.num_modules,
        "policy_fingerprint": cfg.policy_fingerprint}
  with open(os.path.join(directory, CONFIG_FILE), "w") as f:
    json.dump(hf, f, indent=2)


def load_config(directory: str) -> MTPConfig:
  """The `MTPConfig` of ``directory/mtp_config.json``; errors name the file."""
  path = os.path.join(directory, CONFIG_FILE)
  try:
    with open(path) as f:
      hf = json.load(f)
    return MTPConfig(int(hf["num_nextn_predict_layers"]), hf_io.config_from_hf(hf),
                     hf.get("policy_fingerprint", ""))
  except FileNotFoundError as e:
    raise FileNotFoundError(f"{path}: no MTP heads config (save_mtp writes one)") from e
  except KeyError as e:
    raise ValueError(f"{path}: required key {e.args[0]!r} missing") from e
  except (json.JSONDecodeError, ValueError) as e:
    raise ValueError(f"{path}: {e}") from e


def load_mtp(directory: str, policy: ModelConfig | None = None,
             fingerprint: str | None = None) -> MTPHeads:
  """The heads `save_mtp` wrote to ``directory``. With ``policy`` (and its
  ``fingerprint``) the heads are checked against it (`MTPConfig.check_policy`) before
  any tensor is read and run its attention implementation; every tensor's presence and
  shape is checked before any is loaded. Raises ValueError naming the directory and the
  tensor."""
  cfg = load_config(directory)
  if policy is not None:
    cfg.check_policy(policy, fingerprint)
    cfg = dataclasses.replace(
        cfg, policy=cfg.policy.replace(attention_impl=policy.attention_impl))
  reader = hf_io._open_safetensors(os.path.join(directory, WEIGHTS_FILE))
  names = set(reader.keys())
  graphdef, abstract = nnx.split(abstract_heads(cfg))
  flat = dict(nnx.to_flat_state(abstract))
  mapping = _hf_tensors(cfg)
  assert set(flat) == set(mapping), sorted(set(flat) ^ set(mapping))  # internal invariant
  for path, t in mapping.items():
    want = hf_io._expected_hf_shape(t, flat[path].get_value().shape, per_layer=True)
    for i in _layer_ids(cfg):
      name = t.hf_name.format(i=i)
      if name not in names:
        raise ValueError(f"{directory}: tensor {name!r} missing from {WEIGHTS_FILE}")
      got = tuple(reader.get_slice(name).get_shape())
      if got != want:
        raise ValueError(f"{directory}: tensor {name!r} has shape {got}, expected {want}"
                         f" for {CONFIG_FILE}")

  def load_one(path, var):
    t = mapping[path]
    value = np.stack([t.to_ours(reader.get_tensor(t.hf_name.format(i=i)))
                      for i in _layer_ids(cfg)])
    return var.replace(jnp.asarray(value, cfg.policy.dtype))

  state = nnx.from_flat_state({p: load_one(p, v) for p, v in flat.items()})
  return nnx.merge(graphdef, state)
