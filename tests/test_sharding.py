"""Sharding on 8 fake CPU devices: same logits on every mesh, golden param specs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from spec_rl_jax import sharding
from spec_rl_jax.models import hf_io
from spec_rl_jax.models.config import get_preset
from spec_rl_jax.models.transformer import init_decoder

CFG = get_preset("tiny-llama", num_heads=8, num_kv_heads=4, head_dim=8, vocab_size=96)
pytestmark = pytest.mark.mesh  # every test here compiles sharded programs

MESHES = [(1, 8, 1), (2, 2, 2), (1, 2, 4)]


def _logits(model, mesh=None):
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, CFG.vocab_size, (8, 16)), jnp.int32)
  pos = jnp.broadcast_to(jnp.arange(16), (8, 16))
  graphdef, state = nnx.split(model)
  fwd = jax.jit(lambda s, t, p: nnx.merge(graphdef, s)(t, p).logits)
  if mesh is None:
    return np.asarray(fwd(state, tokens, pos))
  with jax.set_mesh(mesh):
    batch = jax.sharding.NamedSharding(mesh, P(("data", "fsdp")))
    return np.asarray(fwd(state, jax.device_put(tokens, batch), jax.device_put(pos, batch)))


@pytest.fixture(scope="module")
def reference():
  return _logits(init_decoder(CFG, seed=7))


@pytest.mark.parametrize("shape", MESHES, ids=str)
def test_mesh_logits_match_single_device(shape, reference):
  assert len(jax.devices()) >= 8
  mesh = sharding.make_mesh(shape)
  model = init_decoder(CFG, seed=7, mesh=mesh)
  # parameters really are distributed
  q = model.layers.attn.q[...]
  assert len(q.sharding.device_set) == 8
  np.testing.assert_allclose(_logits(model, mesh), reference, atol=1e-5)


GOLDEN_2_2_2 = {
    "embed": P("tensor", "fsdp"),
    "final_norm.scale": P(None),
    "lm_head": P("tensor", "fsdp"),
    "layers.attn.q": P(None, "tensor", None, "fsdp"),
    "layers.attn.k": P(None, "tensor", None, "fsdp"),
    "layers.attn.v": P(None, "tensor", None, "fsdp"),
    "layers.attn.o": P(None, "fsdp", "tensor", None),
    "layers.attn_norm.scale": P(None, None),
    "layers.mlp_norm.scale": P(None, None),
    "layers.mlp.gate": P(None, "tensor", "fsdp"),
    "layers.mlp.up": P(None, "tensor", "fsdp"),
    "layers.mlp.down": P(None, "fsdp", "tensor"),
}


def test_param_specs_golden():
  state = nnx.state(init_decoder(CFG))
  assert sharding.spec_table(state, sharding.make_mesh((2, 2, 2))) == GOLDEN_2_2_2


def test_indivisible_dims_are_replicated():
  # 4 KV heads on an 8-way tensor axis: replicated, not an error.
  spec = sharding.logical_to_spec(("embed", "kv_heads", "head_dim"), (64, 4, 8),
                                  {"data": 1, "fsdp": 1, "tensor": 8})
  assert spec == P(None, None, None)
  with pytest.raises(KeyError, match="no rule"):
    sharding.logical_to_spec(("nonsense",), (4,), {"tensor": 2})


def test_sharded_hf_import(tmp_path, reference):
  hf_io.save_hf_checkpoint(init_decoder(CFG, seed=7), str(tmp_path))
  mesh = sharding.make_mesh((1, 2, 4))
  model, _ = hf_io.load_hf_checkpoint(str(tmp_path), mesh=mesh, load_tokenizer=False)
  expected = sharding.logical_to_spec(("layers", "embed", "mlp"), (2, 64, 128),
                                      dict(zip(mesh.axis_names, mesh.axis_sizes)))
  assert model.layers.mlp.down[...].sharding.spec == expected == P(None, "fsdp", "tensor")
  np.testing.assert_allclose(_logits(model, mesh), reference, atol=1e-5)
