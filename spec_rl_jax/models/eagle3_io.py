"""Eagle3 head checkpoints in the serving stacks' layout (``LlamaForCausalLMEagle3``).

The layout SGLang, vLLM and TensorRT-LLM load (``config.json`` + ``model.safetensors``,
single or sharded; the tensor names of EAGLE-3's reference trainer), so a head trained
here is served there and a public head drafts here (a head shipped as
``pytorch_model.bin`` must be converted to safetensors first). ``nn.Linear`` weights are
``[out, in]``, as ours are (models/hf_io.py), so conversion is a reshape:

| ours (`Eagle3Head`)                   | checkpoint                                          |
|---------------------------------------|-----------------------------------------------------|
| ``fc [D, 3D]``                        | ``fc.weight [D, 3D]``                               |
| ``midlayer.input_layernorm.scale``    | ``midlayer.input_layernorm.weight [D]`` (on ``e``)  |
| ``midlayer.hidden_norm.scale``        | ``midlayer.hidden_norm.weight [D]`` (on ``g``)      |
| ``midlayer.q [H, Dh, 2D]``            | ``midlayer.self_attn.q_proj.weight [H·Dh, 2D]``     |
| ``midlayer.k, v [Hk, Dh, 2D]``        | ``midlayer.self_attn.{k,v}_proj.weight [Hk·Dh, 2D]``|
| ``midlayer.o [D, H, Dh]``             | ``midlayer.self_attn.o_proj.weight [D, H·Dh]``      |
| ``midlayer.post_attention_layernorm`` | ``midlayer.post_attention_layernorm.weight [D]``    |
| ``midlayer.mlp.{gate,up,down}``       | ``midlayer.mlp.{gate,up,down}_proj.weight``         |
| ``norm.scale [D]``                    | ``norm.weight [D]``                                 |
| ``lm_head [Vd, D]``                   | ``lm_head.weight [Vd, D]``                          |
| ``d2t [Vd]`` int32                    | ``d2t [Vd]`` int64: policy id = draft id + d2t      |
| (derived from ``d2t``)                | ``t2d [V]`` bool: policy token is in the draft vocab|

q, k and v are stored apart (the stacks fuse them into ``qkv_proj`` when loading).
``d2t`` is required only when ``Vd < V`` (full-vocabulary heads may omit it: the
identity); ``t2d`` is checked when present (the stacks ignore it). Some public heads
carry the target's ``embed_tokens.weight``: it is ignored, as the head reads the
policy's own embedding (models/eagle3.py, `eagle3.embed`).

The feature layers are written under both keys the stacks read, each in its own
convention: vLLM reads top-level ``eagle_aux_hidden_state_layer_ids`` as the layers
whose *input* is captured (our ``feature_layers``); SGLang reads
``eagle_config.eagle_aux_hidden_state_layer_ids`` as the layers whose *output* is
captured (it adds 1; our ``hidden_layers``; TensorRT-LLM's capture layers, default
``(1, L // 2 - 1, L - 4)``, count the same way). Our extras (``policy_layers``,
``policy_fingerprint``) live under ``"spec_rl_jax"``; a public head without them takes
``policy_layers`` (and, without layer ids, the stacks' default feature layers) from
the policy it is loaded for.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from spec_rl_jax.models.config import ModelConfig
from spec_rl_jax.models.eagle3 import (Eagle3Config, Eagle3Head, abstract_head,
                                       default_feature_layers)
from spec_rl_jax.models.hf_io import (_SafetensorsReader, _Tensor, _expected_hf_shape,
                                      _in_heads, _out_heads, _same, _to_host)

ARCHITECTURE = "LlamaForCausalLMEagle3"
EXTRAS_KEY = "spec_rl_jax"
AUX_IDS_KEY = "eagle_aux_hidden_state_layer_ids"
# The target's embedding, which some public heads carry; the policy's is used instead.
IGNORED_TENSORS = ("embed_tokens.weight",)
# config.json settings the head cannot represent: (key, the only value it supports).
_UNSUPPORTED = (("num_hidden_layers", 1), ("hidden_act", "silu"), ("attention_bias", False),
                ("mlp_bias", False), ("norm_before_residual", False))


def _mapping(cfg: Eagle3Config) -> dict[tuple[str, ...], _Tensor]:
  """Our flat state path → checkpoint tensor."""
  return {
      ("fc",): _same("fc.weight"),
      ("midlayer", "input_layernorm", "scale"): _same("midlayer.input_layernorm.weight"),
      ("midlayer", "hidden_norm", "scale"): _same("midlayer.hidden_norm.weight"),
      ("midlayer", "q"): _out_heads("midlayer.self_attn.q_proj.weight", cfg.num_heads),
      ("midlayer", "k"): _out_heads("midlayer.self_attn.k_proj.weight", cfg.num_kv_heads),
      ("midlayer", "v"): _out_heads("midlayer.self_attn.v_proj.weight", cfg.num_kv_heads),
      ("midlayer", "o"): _in_heads("midlayer.self_attn.o_proj.weight", cfg.num_heads),
      ("midlayer", "post_attention_layernorm", "scale"):
          _same("midlayer.post_attention_layernorm.weight"),
      ("midlayer", "mlp", "gate"): _same("midlayer.mlp.gate_proj.weight"),
      ("midlayer", "mlp", "up"): _same("midlayer.mlp.up_proj.weight"),
      ("midlayer", "mlp", "down"): _same("midlayer.mlp.down_proj.weight"),
      ("norm", "scale"): _same("norm.weight"),
      ("lm_head",): _same("lm_head.weight"),
      ("d2t",): _Tensor("d2t", lambda w: w.astype(np.int32), lambda w: w.astype(np.int64)),
  }


# --------------------------------------------------------------------------- config


def config_to_json(cfg: Eagle3Config) -> dict:
  """`Eagle3Config` → ``config.json`` dict."""
  return {
      "architectures": [ARCHITECTURE],
      "model_type": "llama",
      "hidden_size": cfg.embed_dim,
      "intermediate_size": cfg.mlp_dim,
      "num_attention_heads": cfg.num_heads,
      "num_key_value_heads": cfg.num_kv_heads,
      "head_dim": cfg.head_dim,
      "num_hidden_layers": 1,
      "hidden_act": "silu",
      "rms_norm_eps": cfg.norm_eps,
      "rope_theta": cfg.rope_theta,
      "rope_scaling": None,
      "attention_bias": False,
      "mlp_bias": False,
      "max_position_embeddings": cfg.max_position_embeddings,
      "vocab_size": cfg.vocab_size,
      "draft_vocab_size": cfg.draft_vocab_size,
      "tie_word_embeddings": False,
      "torch_dtype": cfg.param_dtype,
      AUX_IDS_KEY: list(cfg.feature_layers),
      "eagle_config": {AUX_IDS_KEY: list(cfg.hidden_layers), "use_aux_hidden_state": True},
      EXTRAS_KEY: {"policy_layers": cfg.policy_layers,
                   "policy_fingerprint": cfg.policy_fingerprint},
  }


def _feature_layers(hf: dict, policy_layers: int) -> tuple[int, ...]:
  """The feature layers (inputs of policy layers) from either stack's key, else the
  stacks' default."""
  vllm = hf.get(AUX_IDS_KEY)
  sglang = (hf.get("eagle_config") or {}).get(AUX_IDS_KEY)
  from_sglang = None if sglang is None else [i + 1 for i in sglang]
  if vllm is not None and from_sglang is not None and list(vllm) != from_sglang:
    raise ValueError(
        f"{AUX_IDS_KEY} {list(vllm)} (vLLM: layers whose input is the feature) and"
        f" eagle_config.{AUX_IDS_KEY} {list(sglang)} (SGLang: layers whose output is the"
        " feature) name different layers; the two stacks would feed the head different"
        " features. Keep the one the head was trained with")
  if vllm is not None:
    return tuple(vllm)
  if from_sglang is not None:
    return tuple(from_sglang)
  return default_feature_layers(policy_layers)


def config_from_json(hf: dict, policy: ModelConfig | None) -> Eagle3Config:
  """``config.json`` dict → `Eagle3Config`; a public head (no ``"spec_rl_jax"`` extras)
  needs ``policy`` for the policy's layer count."""
  archs = hf.get("architectures") or []
  if ARCHITECTURE not in archs:
    raise ValueError(f"architectures {archs} is not [{ARCHITECTURE!r}]: not an Eagle3 head")
  bad = [f"{k}={hf[k]!r}" for k, want in _UNSUPPORTED if hf.get(k, want) != want]
  rope = hf.get("rope_parameters") or {}
  legacy = hf.get("rope_scaling") or {}
  rope_type = rope.get("rope_type") or legacy.get("rope_type") or legacy.get("type")
  if rope_type not in (None, "default"):
    bad.append(f"rope type {rope_type!r}")
  if bad:
    raise ValueError(f"unsupported settings {', '.join(bad)}; the head is one Llama layer"
                     " (SwiGLU, no biases, unscaled RoPE, norm after the residual)")
  if hf.get("target_hidden_size", hf["hidden_size"]) != hf["hidden_size"]:
    raise ValueError(f"target_hidden_size {hf['target_hidden_size']} differs from"
                     f" hidden_size {hf['hidden_size']}; the head reads the policy's"
                     " features at its own width")
  extras = hf.get(EXTRAS_KEY)
  if extras is None and policy is None:
    raise ValueError(f"no {EXTRAS_KEY!r} entry (a public head): pass the policy's"
                     " ModelConfig, which gives the policy's layer count")
  policy_layers = extras["policy_layers"] if extras is not None else policy.num_layers
  heads = hf["num_attention_heads"]
  vocab = hf["vocab_size"]
  return Eagle3Config(
      vocab_size=vocab,
      draft_vocab_size=hf.get("draft_vocab_size") or vocab,
      embed_dim=hf["hidden_size"],
      mlp_dim=hf["intermediate_size"],
      num_heads=heads,
      num_kv_heads=hf.get("num_key_value_heads") or heads,
      head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
      policy_layers=policy_layers,
      feature_layers=_feature_layers(hf, policy_layers),
      rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10_000.0))),
      norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      max_position_embeddings=hf.get("max_position_embeddings", 4096),
      param_dtype="bfloat16" if hf.get("torch_dtype", hf.get("dtype")) == "bfloat16"
      else "float32",
      policy_fingerprint=(extras or {}).get("policy_fingerprint", ""))


def _read_config(directory: str, policy: ModelConfig | None) -> Eagle3Config:
  path = os.path.join(directory, "config.json")
  try:
    with open(path) as f:
      cfg = config_from_json(json.load(f), policy)
    if policy is not None:
      cfg.check_policy(policy)
    return cfg
  except KeyError as e:
    raise ValueError(f"{path}: required key {e.args[0]!r} missing") from e
  except (json.JSONDecodeError, ValueError) as e:
    raise ValueError(f"{path}: {e}") from e


# --------------------------------------------------------------------------- tensors


def _check_vocab_map(where: str, d2t: np.ndarray, t2d: np.ndarray | None,
                     vocab_size: int) -> None:
  """``d2t [Vd]`` must map the draft ids one-to-one into ``[0, V)``; ``t2d [V]`` must mark
  exactly the policy ids mapped to."""
  if not np.issubdtype(d2t.dtype, np.integer):
    raise ValueError(f"{where}: tensor 'd2t' has dtype {d2t.dtype}, expected integer offsets")
  target = np.arange(d2t.shape[0]) + d2t.astype(np.int64)  # [Vd]
  outside = np.flatnonzero((target < 0) | (target >= vocab_size))
  if outside.size:
    d = int(outside[0])
    raise ValueError(f"{where}: tensor 'd2t' maps {outside.size} draft ids outside the"
                     f" policy vocabulary [0, {vocab_size}), e.g. draft id {d} -> {target[d]}")
  ids, counts = np.unique(target, return_counts=True)
  if (counts > 1).any():
    t = int(ids[counts > 1][0])
    raise ValueError(f"{where}: tensor 'd2t' maps draft ids"
                     f" {np.flatnonzero(target == t).tolist()} to the same policy id {t}")
  if t2d is not None:
    want = np.zeros(vocab_size, bool)
    want[target] = True
    wrong = np.flatnonzero(t2d.astype(bool) != want)
    if wrong.size:
      raise ValueError(f"{where}: tensor 't2d' disagrees with 'd2t' at {wrong.size} policy"
                       f" ids, e.g. {wrong[:5].tolist()}")


def load_eagle3(directory: str, policy: ModelConfig | None = None) -> Eagle3Head:
  """Loads an Eagle3 head saved by `save_eagle3` or a public ``LlamaForCausalLMEagle3``
  checkpoint (then ``policy`` is required). With ``policy``, raises unless the head
  was made for it (hidden size, layer count, vocabulary) and runs its attention
  implementation. Every check runs before any array reaches a device; errors name the
  file and the tensor."""
  cfg = _read_config(directory, policy)
  if policy is not None:
    cfg = dataclasses.replace(cfg, attention_impl=policy.attention_impl)
  reader = _SafetensorsReader(directory)
  files = sorted(set(reader.weight_map.values()))
  where = os.path.join(directory, files[0] if len(files) == 1 else "model.safetensors.*")

  graphdef, abstract = nnx.split(abstract_head(cfg))
  flat = dict(nnx.to_flat_state(abstract))
  mapping = _mapping(cfg)
  optional = {"d2t"} if cfg.draft_vocab_size == cfg.vocab_size else set()
  present = set(reader.weight_map)
  missing = sorted({t.hf_name for t in mapping.values()} - present - optional)
  if missing:
    raise ValueError(f"{where}: tensors missing: {missing}")
  unknown = sorted(present - {t.hf_name for t in mapping.values()} - {"t2d"}
                   - set(IGNORED_TENSORS))
  if unknown:
    raise ValueError(f"{where}: unexpected tensors {unknown} (an Eagle3 head holds"
                     f" {sorted(t.hf_name for t in mapping.values())}, t2d and optionally"
                     f" {list(IGNORED_TENSORS)})")
  shapes = {t.hf_name: _expected_hf_shape(t, flat[p].get_value().shape, False)
            for p, t in mapping.items()} | {"t2d": (cfg.vocab_size,)}
  for name, want in shapes.items():
    if name in present and reader.shape(name) != want:
      raise ValueError(f"{os.path.join(directory, reader.weight_map[name])}: tensor {name!r}"
                       f" has shape {reader.shape(name)}, expected {want} for config.json")
  d2t = reader.get("d2t") if "d2t" in present else np.zeros(cfg.draft_vocab_size, np.int64)
  _check_vocab_map(where, d2t, reader.get("t2d") if "t2d" in present else None,
                   cfg.vocab_size)

  def value(path, var):
    t = mapping[path]
    if t.hf_name not in present:  # d2t of a full-vocabulary head: the identity
      return var.replace(jnp.zeros(var.get_value().shape, var.get_value().dtype))
    return var.replace(jnp.asarray(t.to_ours(reader.get(t.hf_name))
                                   .astype(var.get_value().dtype)))

  state = nnx.from_flat_state({p: value(p, v) for p, v in flat.items()})
  return nnx.merge(graphdef, state)


def save_eagle3(head: Eagle3Head, directory: str) -> None:
  """Writes ``model.safetensors`` and ``config.json`` (module docstring). Multi-host:
  every process joins the gathers; process 0 writes."""
  cfg = head.cfg
  flat = dict(nnx.to_flat_state(nnx.state(head)))
  tensors = {t.hf_name: np.ascontiguousarray(t.to_hf(_to_host(flat[p].get_value())))
             for p, t in _mapping(cfg).items()}
  t2d = np.zeros(cfg.vocab_size, bool)  # [V]
  t2d[np.arange(cfg.draft_vocab_size) + tensors["d2t"]] = True
  tensors["t2d"] = t2d
  if jax.process_index() != 0:
    return
  os.makedirs(directory, exist_ok=True)
  save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
  with open(os.path.join(directory, "config.json"), "w") as f:
    json.dump(config_to_json(cfg), f, indent=2)
