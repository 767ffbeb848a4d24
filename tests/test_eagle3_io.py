"""Eagle3 heads in the serving stacks' checkpoint layout (models/eagle3_io.py): our own
round trip, a head written by an independent PyTorch model of the public layer, and
bad checkpoints failing before any device work with errors that name the problem."""

import json
import math
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.numpy import load_file, save_file
from safetensors.torch import save_file as torch_save_file

from spec_rl_jax.models.attention import NoCache
from spec_rl_jax.models.causal_attention import NEG_INF
from spec_rl_jax.models.config import get_preset
from spec_rl_jax.models.eagle3 import Eagle3Config, Eagle3Head, init_head
from spec_rl_jax.models.eagle3_io import config_from_json, load_eagle3, save_eagle3

POLICY = get_preset("tiny-qwen3")  # V 128, D 64, H 4, Hk 2, Dh 16, 2 layers
V, D, VD = POLICY.vocab_size, POLICY.embed_dim, 48
B, T = 2, 6


def _draft_ids(rng, draft_vocab: int) -> np.ndarray:
  """``[Vd]`` sorted policy ids of a random draft vocabulary (all ids when full)."""
  return np.sort(rng.choice(V, draft_vocab, replace=False))


def _random_head(draft_vocab: int, dtype: str = "float32", seed: int = 0) -> Eagle3Head:
  """A head with every leaf random (norm scales too, so a swapped norm shows) and a
  non-trivial ``d2t`` when the draft vocabulary is reduced."""
  cfg = Eagle3Config.for_policy(POLICY.replace(param_dtype=dtype), feature_layers=(1, 1, 1),
                                draft_vocab_size=draft_vocab, fingerprint="0123456789abcdef")
  graphdef, state = nnx.split(init_head(cfg, seed))
  rng = np.random.default_rng(seed)

  def leaf(path, var):
    x = var.get_value()
    if path == ("d2t",):
      new = _draft_ids(rng, draft_vocab) - np.arange(draft_vocab)
    else:
      new = (1.0 if path[-1] == "scale" else 0.0) + 0.1 * rng.standard_normal(x.shape)
    return var.replace(jnp.asarray(new, x.dtype))

  flat = {p: leaf(p, v) for p, v in nnx.to_flat_state(state)}
  return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _inputs(seed: int = 1):
  """``e [B,T,D]``, three features ``[3,B,T,D]``, ``positions [B,T]`` (row 1 offset, so
  RoPE is checked away from position 0)."""
  rng = np.random.default_rng(seed)
  e = rng.standard_normal((B, T, D)).astype(np.float32)
  feats = rng.standard_normal((3, B, T, D)).astype(np.float32)
  positions = np.arange(T)[None] + np.array([[0], [3]])
  return e, feats, positions


def _forward(head: Eagle3Head, e, feats, positions):
  """Our head on ``(e, fc(feats))`` → ``(a [B,T,D], policy logits [B,T,V])``."""
  a, _ = head(jnp.asarray(e, head.fc.dtype), head.fuse(jnp.asarray(feats)),
              jnp.asarray(positions), NoCache())
  return a, head.policy_logits(a)


def _leaves(head: Eagle3Head) -> dict:
  return {p: v.get_value() for p, v in nnx.to_flat_state(nnx.state(head))}


@pytest.mark.parametrize("draft_vocab,dtype", [(VD, "float32"), (V, "bfloat16")])
def test_round_trip(tmp_path, draft_vocab, dtype):
  head = _random_head(draft_vocab, dtype)
  save_eagle3(head, str(tmp_path))
  hf = json.loads((tmp_path / "config.json").read_text())
  assert hf["architectures"] == ["LlamaForCausalLMEagle3"] and hf["num_hidden_layers"] == 1
  assert hf["eagle_aux_hidden_state_layer_ids"] == [1, 1, 1]  # vLLM: inputs of layers
  assert hf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 0, 0]  # SGLang
  assert (hf["vocab_size"], hf["draft_vocab_size"], hf["torch_dtype"]) == (V, draft_vocab,
                                                                           dtype)
  tensors = load_file(str(tmp_path / "model.safetensors"))
  assert tensors["d2t"].dtype == np.int64 and tensors["t2d"].dtype == np.bool_
  assert tensors["t2d"].sum() == draft_vocab
  assert tensors["midlayer.self_attn.q_proj.weight"].shape == (4 * 16, 2 * D)
  assert tensors["midlayer.self_attn.o_proj.weight"].shape == (D, 4 * 16)

  loaded = load_eagle3(str(tmp_path), POLICY)
  assert loaded.cfg == head.cfg
  want, got = _leaves(head), _leaves(loaded)
  assert want.keys() == got.keys()
  for path in want:
    assert got[path].dtype == want[path].dtype, path
    np.testing.assert_array_equal(np.asarray(got[path]), np.asarray(want[path]), err_msg=path)
  inputs = _inputs()
  for x, y in zip(_forward(head, *inputs), _forward(loaded, *inputs)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# --------------------------------------------------------------------------- torch


class _RMSNorm(torch.nn.Module):

  def __init__(self, dim, eps):
    super().__init__()
    self.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(dim))
    self.eps = eps

  def forward(self, x):
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def _rotate_half(x):
  x1, x2 = x.chunk(2, dim=-1)
  return torch.cat([-x2, x1], dim=-1)


class _Attention(torch.nn.Module):
  """Llama attention whose q, k, v read ``2D`` values (``[norm(e); norm(g)]``)."""

  def __init__(self, d, heads, kv_heads, head_dim, theta):
    super().__init__()
    self.heads, self.kv_heads, self.head_dim, self.theta = heads, kv_heads, head_dim, theta
    self.q_proj = torch.nn.Linear(2 * d, heads * head_dim, bias=False)
    self.k_proj = torch.nn.Linear(2 * d, kv_heads * head_dim, bias=False)
    self.v_proj = torch.nn.Linear(2 * d, kv_heads * head_dim, bias=False)
    self.o_proj = torch.nn.Linear(heads * head_dim, d, bias=False)

  def forward(self, x, positions):
    b, t, _ = x.shape
    q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
    k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
    v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
    inv_freq = 1.0 / self.theta ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim)
    angles = positions[..., None].float() * inv_freq  # [b, t, Dh/2]
    emb = torch.cat([angles, angles], -1)[:, None]  # [b, 1, t, Dh]
    q = q * emb.cos() + _rotate_half(q) * emb.sin()
    k = k * emb.cos() + _rotate_half(k) * emb.sin()
    group = self.heads // self.kv_heads
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    return self.o_proj((probs @ v).transpose(1, 2).reshape(b, t, -1))


class _MLP(torch.nn.Module):

  def __init__(self, d, f):
    super().__init__()
    self.gate_proj = torch.nn.Linear(d, f, bias=False)
    self.up_proj = torch.nn.Linear(d, f, bias=False)
    self.down_proj = torch.nn.Linear(f, d, bias=False)

  def forward(self, x):
    return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class _Midlayer(torch.nn.Module):

  def __init__(self, hf):
    super().__init__()
    d, eps = hf["hidden_size"], hf["rms_norm_eps"]
    heads = hf["num_attention_heads"]
    self.input_layernorm = _RMSNorm(d, eps)
    self.hidden_norm = _RMSNorm(d, eps)
    self.self_attn = _Attention(d, heads, hf["num_key_value_heads"], d // heads,
                                hf["rope_theta"])
    self.post_attention_layernorm = _RMSNorm(d, eps)
    self.mlp = _MLP(d, hf["intermediate_size"])

  def forward(self, embeds, hidden, positions):
    residual = hidden
    x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], -1)
    r = residual + self.self_attn(x, positions)
    return r + self.mlp(self.post_attention_layernorm(r))


class _TorchEagle3(torch.nn.Module):
  """The public ``LlamaForCausalLMEagle3`` as the serving stacks define it, with the
  target embedding some public heads carry."""

  def __init__(self, hf, draft_ids):
    super().__init__()
    d = hf["hidden_size"]
    self.embed_tokens = torch.nn.Embedding(hf["vocab_size"], d)
    self.fc = torch.nn.Linear(3 * d, d, bias=False)
    self.midlayer = _Midlayer(hf)
    self.norm = _RMSNorm(d, hf["rms_norm_eps"])
    self.lm_head = torch.nn.Linear(d, hf["draft_vocab_size"], bias=False)
    if draft_ids is not None:
      ids = torch.from_numpy(draft_ids)
      self.register_buffer("d2t", ids - torch.arange(len(ids)))
      t2d = torch.zeros(hf["vocab_size"], dtype=torch.bool)
      t2d[ids] = True
      self.register_buffer("t2d", t2d)

  def forward(self, embeds, features, positions):
    """``features [B,T,3D]`` → ``(a [B,T,D], draft logits [B,T,Vd])``."""
    a = self.midlayer(embeds, self.fc(features), positions)
    return a, self.lm_head(self.norm(a))


@pytest.mark.parametrize("draft_vocab", [VD, V])
def test_public_checkpoint_matches_torch(tmp_path, draft_vocab):
  """A public head (no extras, no head_dim, SGLang's nested layer ids, the target
  embedding; a full-vocabulary head without d2t/t2d) drafts as the torch layer does."""
  hf = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": D, "intermediate_size": 96, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 1, "rms_norm_eps": 1e-5,
        "rope_theta": 100_000.0, "vocab_size": V, "draft_vocab_size": draft_vocab,
        "max_position_embeddings": 2048, "tie_word_embeddings": False,
        "torch_dtype": "float32", "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": [0, 0, 0], "use_aux_hidden_state": True}}
  torch.manual_seed(0)
  draft_ids = _draft_ids(np.random.default_rng(0), draft_vocab) if draft_vocab < V else None
  ref = _TorchEagle3(hf, draft_ids)
  torch_save_file(ref.state_dict(), str(tmp_path / "model.safetensors"))
  (tmp_path / "config.json").write_text(json.dumps(hf))

  head = load_eagle3(str(tmp_path), POLICY)
  assert (head.cfg.feature_layers, head.cfg.policy_layers, head.cfg.head_dim) == ((1, 1, 1),
                                                                                  2, 16)
  assert (head.cfg.mlp_dim, head.cfg.norm_eps, head.cfg.rope_theta) == (96, 1e-5, 1e5)
  e, feats, positions = _inputs()
  with torch.no_grad():
    want_a, want_logits = ref(torch.from_numpy(e), torch.from_numpy(np.concatenate(feats, -1)),
                              torch.from_numpy(positions))
  want_policy = np.full((B, T, V), NEG_INF, np.float32)
  want_policy[..., draft_ids if draft_ids is not None else np.arange(V)] = want_logits.numpy()
  a, policy_logits = _forward(head, e, feats, positions)
  np.testing.assert_allclose(np.asarray(a), want_a.numpy(), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(head.logits(a)), want_logits.numpy(), rtol=1e-5,
                             atol=1e-5)
  np.testing.assert_allclose(np.asarray(policy_logits), want_policy, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("hf,want", [
    ({"eagle_aux_hidden_state_layer_ids": [2, 4, 5]}, (2, 4, 5)),  # vLLM: inputs
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}}, (2, 4, 5)),  # SGLang
    ({}, (2, 4, 5)),  # the stacks' default for 8 layers: (2, L // 2, L - 3)
])
def test_feature_layers_from_either_stack(hf, want):
  base = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": D,
          "intermediate_size": 128, "num_attention_heads": 4, "vocab_size": V}
  assert config_from_json(base | hf, POLICY.replace(num_layers=8)).feature_layers == want


# --------------------------------------------------------------------------- errors


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  d = tmp_path_factory.mktemp("eagle3")
  save_eagle3(_random_head(VD), str(d))
  return d


def _edit_tensors(fn):
  def edit(d):
    tensors = load_file(str(d / "model.safetensors"))
    fn(tensors)
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
  return edit


def _edit_config(fn):
  def edit(d):
    hf = json.loads((d / "config.json").read_text())
    fn(hf)
    (d / "config.json").write_text(json.dumps(hf))
  return edit


def _dup_d2t(t):
  t["d2t"][1] = t["d2t"][0] - 1  # draft ids 0 and 1 -> the same policy id


def _flip_t2d(t):
  t["t2d"][np.flatnonzero(~t["t2d"])[0]] = True


BAD = {
    "missing tensors": (
        _edit_tensors(lambda t: [t.pop("midlayer.mlp.up_proj.weight"), t.pop("norm.weight")]),
        POLICY, "model.safetensors",
        r"tensors missing: \['midlayer\.mlp\.up_proj\.weight', 'norm\.weight'\]"),
    "unexpected tensor": (
        _edit_tensors(lambda t: t.update({"midlayer.self_attn.qkv_proj.weight":
                                          np.zeros((128, 128), np.float32)})),
        POLICY, "model.safetensors",
        r"unexpected tensors \['midlayer\.self_attn\.qkv_proj\.weight'\]"),
    "wrong shape": (
        _edit_tensors(lambda t: t.update({"lm_head.weight": np.zeros((VD + 1, D), np.float32)})),
        POLICY, "model.safetensors",
        r"tensor 'lm_head\.weight' has shape \(49, 64\), expected \(48, 64\)"),
    "d2t outside vocab": (
        _edit_tensors(lambda t: t["d2t"].__setitem__(-1, V)), POLICY, "model.safetensors",
        r"tensor 'd2t' maps 1 draft ids outside the policy vocabulary \[0, 128\), e\.g\."
        r" draft id 47 -> 175"),
    "d2t not one-to-one": (
        _edit_tensors(_dup_d2t), POLICY, "model.safetensors",
        r"tensor 'd2t' maps draft ids \[0, 1\] to the same policy id"),
    "t2d disagrees": (
        _edit_tensors(_flip_t2d), POLICY, "model.safetensors",
        r"tensor 't2d' disagrees with 'd2t' at 1 policy ids"),
    "architecture": (
        _edit_config(lambda hf: hf.update(architectures=["LlamaForCausalLM"])), POLICY,
        "config.json", r"architectures \['LlamaForCausalLM'\] is not \['LlamaForCausalLMEagle3'\]"),
    "hidden size": (
        lambda d: None, POLICY.replace(embed_dim=32), "config.json",
        r"another policy: hidden size 64 \(head\) vs 32 \(policy\)"),
    "vocabulary": (
        lambda d: None, POLICY.replace(vocab_size=256), "config.json",
        r"another policy: vocabulary 128 \(head\) vs 256 \(policy\)"),
    "public head without policy": (
        _edit_config(lambda hf: hf.pop("spec_rl_jax")), None, "config.json",
        r"no 'spec_rl_jax' entry \(a public head\): pass the policy's ModelConfig"),
    "layer ids disagree": (
        _edit_config(lambda hf: hf["eagle_config"].update(
            eagle_aux_hidden_state_layer_ids=[1, 1, 1])), POLICY, "config.json",
        r"eagle_aux_hidden_state_layer_ids \[1, 1, 1\] \(vLLM.*name different layers"),
    "rope scaling": (
        _edit_config(lambda hf: hf.update(rope_scaling={"rope_type": "llama3", "factor": 8.0})),
        POLICY, "config.json", r"unsupported settings rope type 'llama3'"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_checkpoint(tmp_path, saved, case):
  edit, policy, file, match = BAD[case]
  d = tmp_path / "head"
  shutil.copytree(saved, d)
  edit(d)
  with pytest.raises(ValueError, match=match) as info:
    load_eagle3(str(d), policy)
  assert str(info.value).startswith(str(d / file))


def test_target_embedding_is_ignored(tmp_path, saved):
  d = tmp_path / "head"
  shutil.copytree(saved, d)
  _edit_tensors(lambda t: t.update({"embed_tokens.weight": np.ones((V, D), np.float32)}))(d)
  assert load_eagle3(str(d), POLICY).cfg == load_eagle3(str(saved), POLICY).cfg
