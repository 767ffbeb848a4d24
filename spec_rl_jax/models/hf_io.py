"""Hugging Face checkpoint import/export for the Llama / Qwen3 decoder.

Import reads ``config.json`` (``LlamaForCausalLM`` or ``Qwen3ForCausalLM``; without
``architectures``, ``model_type`` ``llama`` or ``qwen3``), single or sharded safetensors
(``model.safetensors.index.json``) and ``tokenizer.json`` (through
`spec_rl_jax.models.tokenizer`; a directory without one is an error unless the caller
asks for the weights alone, ``load_tokenizer=False``). Tensors are read lazily from the
memory-mapped files straight into sharded arrays: each device's shard is assembled by a
``make_array_from_callback`` callback, so no full-size host copy of the model exists.

Export writes the same layout, loadable by ``transformers`` unchanged.

Layout mapping: HF stores ``nn.Linear`` weights as ``[out, in]``, and so do we (the
head dims split out of ``out`` or ``in``), so conversion is a reshape:

| ours                          | HF                                        |
|-------------------------------|-------------------------------------------|
| ``embed [V, D]``              | ``model.embed_tokens.weight [V, D]``      |
| ``layers.attn.q [L,H,Dh,D]``  | ``...self_attn.q_proj.weight [H·Dh, D]``  |
| ``layers.attn.o [L,D,H,Dh]``  | ``...self_attn.o_proj.weight [D, H·Dh]``  |
| ``layers.mlp.gate [L,F,D]``   | ``...mlp.gate_proj.weight [F, D]``        |
| ``lm_head [V, D]``            | ``lm_head.weight [V, D]``                 |
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Callable

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from spec_rl_jax import sharding
from spec_rl_jax.models.config import ARCHITECTURES, Arch, Llama3RopeScaling, ModelConfig
from spec_rl_jax.models.tokenizer import Tokenizer, check_vocab
from spec_rl_jax.models.transformer import Decoder, abstract_decoder

log = logging.getLogger(__name__)

# Tensors some HF checkpoints carry that the model recomputes or ties.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
TOKENIZER_FILE = "tokenizer.json"


# --------------------------------------------------------------------------- config


def _architecture(hf: dict) -> Arch:
  """Our architecture of a ``config.json``: from ``architectures``, else (as
  ``transformers``' auto classes do) from ``model_type``."""
  archs, model_type = hf.get("architectures") or [], hf.get("model_type")
  supported = (f"supported: architectures {sorted(ARCHITECTURES)}, or without"
               f" architectures model_type {sorted(set(ARCHITECTURES.values()))}")
  if archs:
    arch = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
    if arch is None:
      raise ValueError(f"unsupported architectures {archs} (model_type {model_type!r}) in"
                       f" config.json; {supported}")
    return arch
  if model_type in ARCHITECTURES.values():
    return model_type
  raise ValueError(f"config.json has no 'architectures' and model_type {model_type!r};"
                   f" {supported}")


def config_from_hf(hf: dict, param_dtype: str | None = None) -> ModelConfig:
  """``config.json`` dict → `ModelConfig` (legacy ``rope_scaling`` or ``rope_parameters``)."""
  arch = _architecture(hf)
  for flag in ("attention_bias", "mlp_bias", "use_sliding_window"):
    if hf.get(flag):
      raise ValueError(f"config.json sets {flag}=true, which this decoder does not support")
  if hf.get("hidden_act", "silu") != "silu":
    raise ValueError(f"hidden_act {hf['hidden_act']!r} unsupported; only 'silu' (SwiGLU)")

  rope = dict(hf.get("rope_parameters") or {})
  legacy = hf.get("rope_scaling") or {}
  theta = rope.get("rope_theta", hf.get("rope_theta", 10_000.0))
  rope_type = rope.get("rope_type") or legacy.get("rope_type") or legacy.get("type") or "default"
  scaling_src = rope if rope.get("rope_type") else legacy
  if rope_type == "default":
    scaling = None
  elif rope_type == "llama3":
    scaling = Llama3RopeScaling(
        factor=float(scaling_src["factor"]),
        low_freq_factor=float(scaling_src["low_freq_factor"]),
        high_freq_factor=float(scaling_src["high_freq_factor"]),
        original_max_position_embeddings=int(scaling_src["original_max_position_embeddings"]))
  else:
    raise ValueError(f"rope type {rope_type!r} unsupported; supported: default, llama3")

  heads = hf["num_attention_heads"]
  torch_dtype = hf.get("torch_dtype", hf.get("dtype"))
  return ModelConfig(
      arch=arch,
      vocab_size=hf["vocab_size"],
      embed_dim=hf["hidden_size"],
      mlp_dim=hf["intermediate_size"],
      num_layers=hf["num_hidden_layers"],
      num_heads=heads,
      num_kv_heads=hf.get("num_key_value_heads") or heads,
      head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
      rope_theta=float(theta),
      rope_scaling=scaling,
      norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      qk_norm=arch == "qwen3",
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      max_position_embeddings=hf.get("max_position_embeddings", 4096),
      param_dtype=param_dtype or ("bfloat16" if torch_dtype == "bfloat16" else "float32"),
  )


def config_to_hf(cfg: ModelConfig, tokenizer: Tokenizer | None = None) -> dict:
  """`ModelConfig` → ``config.json`` dict (legacy rope keys: read by every version)."""
  arch_name = {v: k for k, v in ARCHITECTURES.items()}[cfg.arch]
  hf = {
      "architectures": [arch_name],
      "model_type": cfg.arch,
      "vocab_size": cfg.vocab_size,
      "hidden_size": cfg.embed_dim,
      "intermediate_size": cfg.mlp_dim,
      "num_hidden_layers": cfg.num_layers,
      "num_attention_heads": cfg.num_heads,
      "num_key_value_heads": cfg.num_kv_heads,
      "head_dim": cfg.head_dim,
      "hidden_act": "silu",
      "max_position_embeddings": cfg.max_position_embeddings,
      "rms_norm_eps": cfg.norm_eps,
      "rope_theta": cfg.rope_theta,
      "rope_scaling": (None if cfg.rope_scaling is None else
                       {"rope_type": "llama3", **dataclasses.asdict(cfg.rope_scaling)}),
      "tie_word_embeddings": cfg.tie_embeddings,
      "attention_bias": False,
      "torch_dtype": cfg.param_dtype,
  }
  if cfg.arch == "llama":
    hf["mlp_bias"] = False
  if tokenizer is not None:
    hf["eos_token_id"] = (list(tokenizer.eos_ids) if len(tokenizer.eos_ids) > 1
                          else tokenizer.eos_ids[0])
    hf["pad_token_id"] = tokenizer.pad_id
    if tokenizer.bos_id is not None:
      hf["bos_token_id"] = tokenizer.bos_id
  return hf


# --------------------------------------------------------------------------- mapping


@dataclasses.dataclass(frozen=True)
class _Tensor:
  """One of our parameters ↔ one HF tensor (per layer when ``per_layer``).

  ``heads``: the HF axis that holds ``n·Dh`` when ``to_ours`` splits it into our
  ``[n, Dh]`` (None: ``to_ours`` keeps the shape), so a slice of ours that takes whole
  heads is one slice of the HF tensor, and `read` loads only that."""

  hf_name: str  # may contain ``{i}`` for the layer index
  to_ours: Callable[[np.ndarray], np.ndarray]
  to_hf: Callable[[np.ndarray], np.ndarray]
  heads: int | None = None

  @property
  def per_layer(self) -> bool:
    return "{i}" in self.hf_name

  def read(self, reader: _SafetensorsReader, name: str, index: tuple[slice, ...],
           shape: tuple[int, ...]) -> np.ndarray:
    """``to_ours(tensor)[index]`` for our (one layer's) ``shape``, reading from the file
    only the HF slice it needs."""
    index = tuple(slice(*s.indices(n)) for s, n in zip(index, shape))
    if self.heads is None:
      return self.to_ours(reader.get(name, index))
    a, dh = self.heads, shape[self.heads + 1]
    heads, within = index[a], index[a + 1]
    w = reader.get(name, (*index[:a], slice(heads.start * dh, heads.stop * dh),
                          *index[a + 2:]))
    w = w.reshape(*w.shape[:a], -1, dh, *w.shape[a + 1:])
    return w[(slice(None),) * (a + 1) + (within,)]


def _same(name: str) -> _Tensor:
  return _Tensor(name, lambda w: w, lambda w: w)


def _out_heads(name: str, n: int) -> _Tensor:
  """``[n·Dh, D]`` (HF) ↔ ``[n, Dh, D]`` (ours): q, k, v projections."""
  return _Tensor(name, lambda w: w.reshape(n, -1, w.shape[1]),
                 lambda w: w.reshape(-1, w.shape[-1]), heads=0)


def _in_heads(name: str, n: int) -> _Tensor:
  """``[D, n·Dh]`` (HF) ↔ ``[D, n, Dh]`` (ours): the output projection."""
  return _Tensor(name, lambda w: w.reshape(w.shape[0], n, -1),
                 lambda w: w.reshape(w.shape[0], -1), heads=1)


def _mapping(cfg: ModelConfig) -> dict[tuple[str, ...], _Tensor]:
  """Our flat state path → HF tensor."""
  pre = "model.layers.{i}."
  m = {
      ("embed",): _same("model.embed_tokens.weight"),
      ("final_norm", "scale"): _same("model.norm.weight"),
      ("layers", "attn_norm", "scale"): _same(pre + "input_layernorm.weight"),
      ("layers", "mlp_norm", "scale"): _same(pre + "post_attention_layernorm.weight"),
      ("layers", "attn", "q"): _out_heads(pre + "self_attn.q_proj.weight", cfg.num_heads),
      ("layers", "attn", "k"): _out_heads(pre + "self_attn.k_proj.weight", cfg.num_kv_heads),
      ("layers", "attn", "v"): _out_heads(pre + "self_attn.v_proj.weight", cfg.num_kv_heads),
      ("layers", "attn", "o"): _in_heads(pre + "self_attn.o_proj.weight", cfg.num_heads),
      ("layers", "mlp", "gate"): _same(pre + "mlp.gate_proj.weight"),
      ("layers", "mlp", "up"): _same(pre + "mlp.up_proj.weight"),
      ("layers", "mlp", "down"): _same(pre + "mlp.down_proj.weight"),
  }
  if cfg.qk_norm:
    m[("layers", "attn", "q_norm", "scale")] = _same(pre + "self_attn.q_norm.weight")
    m[("layers", "attn", "k_norm", "scale")] = _same(pre + "self_attn.k_norm.weight")
  if not cfg.tie_embeddings:
    m[("lm_head",)] = _same("lm_head.weight")
  return m


def _hf_names(t: _Tensor, num_layers: int) -> list[str]:
  return [t.hf_name.format(i=i) for i in range(num_layers)] if t.per_layer else [t.hf_name]


# --------------------------------------------------------------------------- import


class _SafetensorsReader:
  """Name → lazily read numpy tensor over one or many ``.safetensors`` files."""

  def __init__(self, directory: str):
    self.directory = directory
    index = os.path.join(directory, "model.safetensors.index.json")
    single = os.path.join(directory, "model.safetensors")
    if os.path.exists(index):
      with open(index) as f:
        weight_map = json.load(f)["weight_map"]
    elif os.path.exists(single):
      weight_map = None
    else:
      raise FileNotFoundError(f"{directory}: neither model.safetensors nor"
                              " model.safetensors.index.json found")
    files = sorted(set(weight_map.values())) if weight_map else ["model.safetensors"]
    self._handles = {f: _open_safetensors(os.path.join(directory, f)) for f in files}
    if weight_map is None:
      weight_map = {k: files[0] for k in self._handles[files[0]].keys()}
    self.weight_map = weight_map

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self._handles[self.weight_map[name]].get_slice(name).get_shape())

  def get(self, name: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
    """``tensor[index]`` (a slice of every axis; None: the whole tensor), reading only
    those bytes; logged at DEBUG level (which process read which slices)."""
    if index is None:
      index = tuple(slice(0, n) for n in self.shape(name))
    log.debug("%s: read %s %s", self.directory, name, [(s.start, s.stop) for s in index])
    return self._handles[self.weight_map[name]].get_slice(name)[index]


def _open_safetensors(path: str):
  """``safe_open(path)``; a missing or unreadable file (truncated, a Git LFS pointer)
  raises naming ``path``."""
  if not os.path.exists(path):
    raise FileNotFoundError(f"{path}: safetensors file missing (listed in"
                            " model.safetensors.index.json)")
  try:
    return safe_open(path, "numpy")
  except SafetensorError as e:
    raise ValueError(f"{path}: unreadable safetensors file ({e}); is it truncated (an"
                     " interrupted download or copy) or a Git LFS pointer?") from e


def _read_config(directory: str, param_dtype: str | None) -> ModelConfig:
  """The `ModelConfig` of ``directory/config.json``; errors name the file."""
  path = os.path.join(directory, "config.json")
  try:
    with open(path) as f:
      return config_from_hf(json.load(f), param_dtype)
  except KeyError as e:
    raise ValueError(f"{path}: required key {e.args[0]!r} missing") from e
  except (json.JSONDecodeError, ValueError) as e:
    raise ValueError(f"{path}: {e}") from e


def _expected_hf_shape(t: _Tensor, ours: tuple[int, ...], per_layer: bool) -> tuple[int, ...]:
  one = ours[1:] if per_layer else ours
  return t.to_hf(np.empty(one, np.int8)).shape


def load_hf_checkpoint(directory: str, mesh: Mesh | None = None, *,
                       param_dtype: str | None = None, load_tokenizer: bool = True,
                       rules=sharding.RULES) -> tuple[Decoder, Tokenizer | None]:
  """Loads a HF checkpoint directory into a (sharded) `Decoder` and its tokenizer
  (``None`` with ``load_tokenizer=False``).

  Raises naming the directory if ``tokenizer.json`` is missing (unless
  ``load_tokenizer=False``), with the tensor's name if a tensor is missing or
  mis-shaped, and if the tokenizer has more ids than the model's vocabulary.
  """
  cfg = _read_config(directory, param_dtype)
  if load_tokenizer and not os.path.exists(os.path.join(directory, TOKENIZER_FILE)):
    raise FileNotFoundError(
        f"{directory}: no {TOKENIZER_FILE}; copy the model's tokenizer files"
        f" ({TOKENIZER_FILE}, tokenizer_config.json) into it, or pass load_tokenizer=False"
        " to load the weights alone")
  tokenizer = None
  if load_tokenizer:
    tokenizer = Tokenizer.load(directory)
    check_vocab(tokenizer, cfg.vocab_size)

  reader = _SafetensorsReader(directory)
  graphdef, abstract = nnx.split(abstract_decoder(cfg))
  mesh = sharding.make_mesh((1, 1, 1)) if mesh is None else mesh
  shardings = dict(nnx.to_flat_state(sharding.state_shardings(abstract, mesh, rules)))
  mapping = _mapping(cfg)

  flat = dict(nnx.to_flat_state(abstract))
  missing_ours = set(flat) - set(mapping)
  assert not missing_ours, f"no HF mapping for {sorted(missing_ours)}"  # internal invariant

  # Validate every tensor before touching any data.
  used = set()
  for path, t in mapping.items():
    shape = flat[path].get_value().shape
    want = _expected_hf_shape(t, shape, t.per_layer)
    for name in _hf_names(t, cfg.num_layers):
      if name not in reader.weight_map:
        raise KeyError(f"{directory}: tensor {name!r} missing from the checkpoint")
      got = reader.shape(name)
      if got != want:
        raise ValueError(f"{directory}: tensor {name!r} has shape {got}, expected {want}"
                         f" for this config.json")
      used.add(name)
  extra = [n for n in reader.weight_map if n not in used
           and not n.endswith(_IGNORED_SUFFIXES)
           and not (cfg.tie_embeddings and n == "lm_head.weight")]
  if extra:
    log.warning("%s: ignoring %d tensors not used by the model, e.g. %s",
                directory, len(extra), extra[:5])

  def load_one(path, var):
    t, shape, dtype = mapping[path], var.get_value().shape, cfg.dtype

    def callback(index):
      if t.per_layer:
        return np.stack([t.read(reader, t.hf_name.format(i=i), index[1:], shape[1:])
                         for i in range(shape[0])[index[0]]]).astype(dtype)
      return t.read(reader, t.hf_name, index, shape).astype(dtype)

    return var.replace(jax.make_array_from_callback(shape, shardings[path], callback))

  state = nnx.from_flat_state({p: load_one(p, v) for p, v in flat.items()})
  return nnx.merge(graphdef, state), tokenizer


# --------------------------------------------------------------------------- export


def _to_host(x: jax.Array) -> np.ndarray:
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(jax.device_get(x))


def save_hf_checkpoint(model: Decoder, directory: str, tokenizer: Tokenizer | None = None,
                       max_shard_bytes: int = 2 * 1024**3) -> None:
  """Writes ``config.json``, safetensors (sharded above ``max_shard_bytes``) and tokenizer.

  Tensors are gathered to the host one file at a time. Multi-host: every process joins
  the gathers; process 0 writes.
  """
  cfg = model.cfg
  if tokenizer is not None:
    check_vocab(tokenizer, cfg.vocab_size)
  flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))

  # Plan the files from shapes alone: [(hf name, our path, layer or None)] per file.
  files: list[list[tuple[str, tuple[str, ...], int | None]]] = [[]]
  size = total = 0
  for path, t in _mapping(cfg).items():
    value = flat[path].get_value()
    nbytes = value.nbytes // (cfg.num_layers if t.per_layer else 1)
    for i in (range(cfg.num_layers) if t.per_layer else [None]):
      if size and size + nbytes > max_shard_bytes:
        files.append([])
        size = 0
      files[-1].append((t.hf_name.format(i=i), path, i))
      size += nbytes
      total += nbytes

  writer = jax.process_index() == 0
  if writer:
    os.makedirs(directory, exist_ok=True)
  mapping = _mapping(cfg)
  names = (["model.safetensors"] if len(files) == 1 else
           [f"model-{n:05d}-of-{len(files):05d}.safetensors" for n in range(1, len(files) + 1)])
  for fname, entries in zip(names, files):
    tensors = {}
    for name, path, i in entries:
      value = flat[path].get_value()
      tensors[name] = np.ascontiguousarray(
          mapping[path].to_hf(_to_host(value if i is None else value[i])))
    if writer:
      save_file(tensors, os.path.join(directory, fname), metadata={"format": "pt"})
  if not writer:
    return

  if len(files) > 1:
    weight_map = {name: fname for fname, entries in zip(names, files) for name, _, _ in entries}
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
      json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
  with open(os.path.join(directory, "config.json"), "w") as f:
    json.dump(config_to_hf(cfg, tokenizer), f, indent=2)
  if tokenizer is not None:
    tokenizer.save(directory)
    gen = {"eos_token_id": list(tokenizer.eos_ids), "pad_token_id": tokenizer.pad_id}
    if tokenizer.bos_id is not None:
      gen["bos_token_id"] = tokenizer.bos_id
    with open(os.path.join(directory, "generation_config.json"), "w") as f:
      json.dump(gen, f, indent=2)
