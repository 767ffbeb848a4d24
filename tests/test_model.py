"""Model presets, bf16 numerics, caches and hidden states."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from spec_rl_jax.models import hf_io, layout, transformer
from spec_rl_jax.models.attention import NoCache
from spec_rl_jax.models.config import PRESETS, get_preset
from spec_rl_jax.models.kv_cache import ContiguousKVCache
from spec_rl_jax.models.transformer import abstract_decoder, init_decoder, param_count

BIG = ["qwen3-0.6b", "qwen3-1.7b", "qwen3-8b", "llama-3.2-1b", "llama-3.1-8b"]
# Published totals (model cards / safetensors index), cross-checked against
# transformers on the meta device below.
PUBLISHED = {"qwen3-8b": 8_190_735_360, "llama-3.1-8b": 8_030_261_248,
             "llama-3.2-1b": 1_235_814_400}


@pytest.mark.parametrize("name", BIG)
def test_preset_param_count_matches_transformers(name):
  cfg = get_preset(name)
  ours = param_count(abstract_decoder(cfg))  # shapes only, nothing allocated
  hf_cfg = transformers.AutoConfig.for_model(**hf_io.config_to_hf(cfg))
  with torch.device("meta"):
    hf = transformers.AutoModelForCausalLM.from_config(hf_cfg)
  hf_count = sum(p.numel() for p in hf.parameters())  # tied weights counted once
  assert ours == hf_count
  if name in PUBLISHED:
    assert ours == PUBLISHED[name]


def test_presets_are_valid_and_named():
  assert set(BIG) <= set(PRESETS)
  with pytest.raises(KeyError, match="known presets"):
    get_preset("qwen3-9000b")


def _batch(cfg, B=3, T=24, seed=0):
  rng = np.random.default_rng(seed)
  tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, T)), jnp.int32)
  return tokens, jnp.broadcast_to(jnp.arange(T), (B, T))


def test_bf16_forward_close_to_fp32():
  """bf16 params/activations vs fp32, same weights.

  bf16 keeps 8 mantissa bits (relative rounding 2^-9 ≈ 2e-3 per op); through 2 layers
  of matmuls with fp32 accumulation the logits drift by a few 1e-3 relative. We
  require max |Δlogit| ≤ 0.05 · max|logit| and the same argmax on ≥ 95% of positions
  (ties within bf16 noise may flip).
  """
  cfg32 = get_preset("tiny-qwen3")
  m32 = init_decoder(cfg32, seed=0)
  m16 = init_decoder(cfg32.replace(param_dtype="bfloat16"), seed=0)
  from flax import nnx
  nnx.update(m16, jax.tree.map(lambda x: x.astype(jnp.bfloat16), nnx.state(m32)))
  tokens, pos = _batch(cfg32)
  l32 = np.asarray(m32(tokens, pos).logits)
  l16 = np.asarray(m16(tokens, pos).logits)
  assert l16.dtype == np.float32
  scale = np.abs(l32).max()
  assert np.abs(l16 - l32).max() <= 0.05 * scale
  assert (l16.argmax(-1) == l32.argmax(-1)).mean() >= 0.95


def test_contiguous_cache_prefill_then_decode_matches_full_forward():
  cfg = get_preset("tiny-llama")
  model = init_decoder(cfg, seed=1)
  tokens, pos = _batch(cfg, B=2, T=12)
  full = np.asarray(model(tokens, pos).logits)
  cache = ContiguousKVCache.init(cfg, 2, 16)
  out = model(tokens[:, :8], pos[:, :8], cache=cache)
  steps = [np.asarray(out.logits)]
  cache = out.cache
  for t in range(8, 12):  # one token at a time, then check
    out = model(tokens[:, t:t + 1], pos[:, t:t + 1], cache=cache)
    cache = out.cache
    steps.append(np.asarray(out.logits))
  np.testing.assert_allclose(np.concatenate(steps, 1), full, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 8])
def test_inference_weight_layouts_match_the_stacked_forward(rows):
  """CPU per-layer copies, output-major (1 row) or input-major (from 2 rows): the same
  logits as the scanned forward over the stored weights."""
  cfg = get_preset("tiny-qwen3").replace(num_layers=3)
  model = init_decoder(cfg, seed=3)
  tokens, pos = _batch(cfg, B=2, T=10)
  weights = layout.CpuLayerCopies().weights(model, rows)
  H, Dh, D, F = cfg.num_heads, cfg.head_dim, cfg.embed_dim, cfg.mlp_dim
  attn, mlp = weights.layers[1]["attn"], weights.layers[1]["mlp"]
  input_major = rows >= layout.INPUT_MAJOR_MIN_ROWS
  assert attn["q"].get_metadata().get("input_major", False) == input_major
  assert attn["q"][...].shape == ((D, H, Dh) if input_major else (H, Dh, D))
  assert attn["o"][...].shape == ((H, Dh, D) if input_major else (D, H, Dh))
  assert mlp["down"][...].shape == ((F, D) if input_major else (D, F))
  np.testing.assert_array_equal(  # the copy holds layer 1's weights, transposed or not
      attn["q"][...], np.transpose(model.layers.attn.q[...][1], (2, 0, 1)) if input_major
      else model.layers.attn.q[...][1])
  got = transformer.apply(nnx.graphdef(model), weights, tokens, pos).logits
  np.testing.assert_allclose(np.asarray(got), np.asarray(model(tokens, pos).logits),
                             atol=2e-5)


@pytest.mark.slow
def test_hidden_layers_and_remat():
  cfg = get_preset("tiny-qwen3").replace(num_layers=3)
  model = init_decoder(cfg, seed=2)
  tokens, pos = _batch(cfg, B=2, T=8)
  out = model(tokens, pos, hidden_layers=(0, 2))
  assert out.hidden.shape == (2, 2, 8, cfg.embed_dim)
  # Layer 2 is the last: final norm of its output gives the logits.
  np.testing.assert_allclose(model.logits(model.final_norm(out.hidden[1])), out.logits,
                             atol=1e-5)
  with pytest.raises(ValueError, match="outside"):
    model(tokens, pos, hidden_layers=(3,))
  # remat changes memory, not values (forward and gradient).
  from flax import nnx
  remat = init_decoder(cfg.replace(remat=True), seed=2)

  def loss(m):
    return m(tokens, pos).logits.mean()

  g1 = nnx.grad(loss)(model)
  g2 = nnx.grad(loss)(remat)
  for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
    np.testing.assert_allclose(a, b, atol=1e-6)


def test_padding_does_not_leak():
  """A padded row's real-token logits equal those of the unpadded row."""
  cfg = get_preset("tiny-qwen3")
  model = init_decoder(cfg, seed=4)
  tokens, pos = _batch(cfg, B=1, T=10)
  alone = np.asarray(model(tokens[:, :6], pos[:, :6]).logits)
  valid = jnp.arange(10)[None] < 6
  padded = np.asarray(model(tokens, pos, cache=NoCache(valid=valid)).logits)
  np.testing.assert_allclose(padded[:, :6], alone, atol=1e-5)


def test_blocked_attention_equals_unblocked(monkeypatch):
  """`NoCache` in query blocks (3 blocks of 4 rows, the last one short) equals one block:
  logits and gradients, right- and left-padded rows."""
  from spec_rl_jax.models import causal_attention
  cfg = get_preset("tiny-qwen3")
  model = init_decoder(cfg, seed=5)
  tokens, pos = _batch(cfg, B=2, T=10)
  valid = jnp.asarray([[True] * 7 + [False] * 3, [False] * 2 + [True] * 8])

  def run():
    loss = lambda m: (m(tokens, pos, cache=NoCache(valid=valid)).logits * valid[..., None]).sum()
    value, grads = nnx.value_and_grad(loss)(model)
    return model(tokens, pos, cache=NoCache(valid=valid)).logits, value, grads

  whole = run()
  monkeypatch.setattr(causal_attention, "QUERY_BLOCK", 4)
  blocked = run()
  np.testing.assert_allclose(np.asarray(blocked[0]) * valid[..., None],
                             np.asarray(whole[0]) * valid[..., None], atol=1e-5)
  np.testing.assert_allclose(blocked[1], whole[1], rtol=1e-5)
  # Gradients of a sum over 17 tokens x 256 logits (entries up to ~25): fp32 sums in
  # another order differ by up to 3e-5.
  for a, b in zip(jax.tree.leaves(blocked[2]), jax.tree.leaves(whole[2])):
    np.testing.assert_allclose(a, b, atol=1e-4)


@pytest.mark.parametrize("block", [4, pytest.param(16, marks=pytest.mark.slow)])
def test_causal_attention_gradients_match_autodiff_reference(monkeypatch, block):
  """The recomputing backward of `causal_attention` (GQA, padding on both sides, blocks
  of 4 rows or one block) equals autodiff through the reference softmax attention with
  the full causal mask, in float64; rows with no visible key are zero either way."""
  from spec_rl_jax.models import attention, causal_attention
  monkeypatch.setattr(causal_attention, "QUERY_BLOCK", block)
  B, T, H, K, Dh = 3, 10, 4, 2, 8
  with jax.enable_x64(True):
    rng = np.random.default_rng(0)
    q, k, v, w = (jnp.asarray(rng.standard_normal(s)) for s in
                  [(B, T, H, Dh), (B, T, K, Dh), (B, T, K, Dh), (B, T, H, Dh)])
    valid = jnp.asarray(np.arange(T)[None] < np.array([[10], [6], [10]]))
    valid &= jnp.asarray(np.arange(T)[None] >= np.array([[0], [0], [3]]))
    mask = (jnp.arange(T)[:, None] >= jnp.arange(T)[None]) & valid[:, None, :]

    def loss(fn):  # a random linear read-out of every row: every cotangent is non-zero
      return lambda q, k, v: jnp.sum(fn(q, k, v) * w)

    ours = jax.value_and_grad(loss(lambda q, k, v: causal_attention.causal_attention(
        q, k, v, valid)), argnums=(0, 1, 2))(q, k, v)
    ref = jax.value_and_grad(loss(lambda q, k, v: attention.dot_product_attention(
        q, k, v, mask)), argnums=(0, 1, 2))(q, k, v)
    out = causal_attention.causal_attention(q, k, v, valid)
    assert out.dtype == jnp.float64
    np.testing.assert_array_equal(out[2, :3], 0.0)
    np.testing.assert_allclose(out, attention.dot_product_attention(q, k, v, mask),
                               atol=1e-12)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(ref)):
      assert np.abs(b).max() > 0.1
      np.testing.assert_allclose(a, b, atol=1e-12)


def test_config_validation():
  with pytest.raises(ValueError, match="multiple of num_kv_heads"):
    get_preset("tiny-qwen3", num_kv_heads=3)
  with pytest.raises(ValueError, match="param_dtype"):
    get_preset("tiny-qwen3", param_dtype="float16")
  with pytest.raises(ValueError, match="attention_impl"):
    init_decoder(get_preset("tiny-qwen3", attention_impl="cuda-magic"))(
        jnp.zeros((1, 1), jnp.int32), jnp.zeros((1, 1), jnp.int32))
