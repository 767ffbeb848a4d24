"""Bad checkpoints fail with errors that name the problem."""

import json
import os

import numpy as np
import pytest
import tokenizers
from safetensors.numpy import load_file, save_file

from spec_rl_jax import checkpoint
from spec_rl_jax.models import hf_io
from spec_rl_jax.models.config import get_preset
from spec_rl_jax.models.tokenizer import Tokenizer
from spec_rl_jax.models.transformer import init_decoder


@pytest.fixture
def ckpt(tmp_path):
  hf_io.save_hf_checkpoint(init_decoder(get_preset("tiny-qwen3")), str(tmp_path))
  return tmp_path


def _edit_config(d, **kw):
  p = d / "config.json"
  cfg = json.loads(p.read_text())
  cfg.update(kw)
  p.write_text(json.dumps(cfg))


def _edit_tensors(d, fn):
  tensors = load_file(str(d / "model.safetensors"))
  fn(tensors)
  save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})


def test_unsupported_architecture_lists_supported(ckpt):
  _edit_config(ckpt, architectures=["MixtralForCausalLM"])
  with pytest.raises(ValueError, match=r"MixtralForCausalLM.*LlamaForCausalLM.*Qwen3ForCausalLM"):
    hf_io.load_hf_checkpoint(str(ckpt))


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_model_type_without_architectures(model_type):
  hf = hf_io.config_to_hf(get_preset(f"tiny-{model_type}"))
  del hf["architectures"]
  assert hf_io.config_from_hf(hf).arch == model_type


@pytest.mark.parametrize("model_type", ["mistral", None])
def test_unsupported_model_type_without_architectures(tmp_path, model_type):
  hf = hf_io.config_to_hf(get_preset("tiny-llama"))
  (tmp_path / "config.json").write_text(json.dumps(hf | {"architectures": None,
                                                          "model_type": model_type}))
  with pytest.raises(ValueError, match=(
      rf"config\.json: config\.json has no 'architectures' and model_type {model_type!r};"
      r" supported: architectures \['LlamaForCausalLM', 'Qwen3ForCausalLM'\], or without"
      r" architectures model_type \['llama', 'qwen3'\]")):
    hf_io.load_hf_checkpoint(str(tmp_path), load_tokenizer=False)


def test_missing_tokenizer_names_directory_and_way_out(ckpt):
  with pytest.raises(FileNotFoundError, match=(
      rf"{ckpt}: no tokenizer\.json; .* or pass load_tokenizer=False to load the weights")):
    hf_io.load_hf_checkpoint(str(ckpt))
  model, tokenizer = hf_io.load_hf_checkpoint(str(ckpt), load_tokenizer=False)
  assert tokenizer is None and model.cfg == get_preset("tiny-qwen3")
  # `load_model` serves draft models too, which may come without a tokenizer.
  model, tokenizer = checkpoint.load_model(str(ckpt))
  assert tokenizer is None and model.cfg == get_preset("tiny-qwen3")


def test_truncated_safetensors_names_the_file(ckpt):
  path = ckpt / "model.safetensors"
  path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])
  with pytest.raises(ValueError, match=rf"{path}: unreadable safetensors file .*truncated"):
    hf_io.load_hf_checkpoint(str(ckpt), load_tokenizer=False)


def test_missing_shard_names_the_file(tmp_path):
  hf_io.save_hf_checkpoint(init_decoder(get_preset("tiny-qwen3")), str(tmp_path),
                           max_shard_bytes=64 * 1024)
  index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
  shard = tmp_path / sorted(set(index["weight_map"].values()))[-1]
  shard.unlink()
  with pytest.raises(FileNotFoundError, match=rf"{shard}: safetensors file missing"):
    hf_io.load_hf_checkpoint(str(tmp_path), load_tokenizer=False)


def test_unsupported_rope_type(ckpt):
  _edit_config(ckpt, rope_scaling={"rope_type": "yarn", "factor": 4.0})
  with pytest.raises(ValueError, match="yarn"):
    hf_io.load_hf_checkpoint(str(ckpt))


def test_missing_tensor_is_named(ckpt):
  _edit_tensors(ckpt, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
  with pytest.raises(KeyError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*missing"):
    hf_io.load_hf_checkpoint(str(ckpt), load_tokenizer=False)


def test_misshaped_tensor_is_named(ckpt):
  def shrink(t):
    t["model.layers.0.self_attn.k_proj.weight"] = t["model.layers.0.self_attn.k_proj.weight"][:-1]
  _edit_tensors(ckpt, shrink)
  with pytest.raises(ValueError, match=r"k_proj\.weight.*shape \(31, 64\), expected \(32, 64\)"):
    hf_io.load_hf_checkpoint(str(ckpt), load_tokenizer=False)


def test_no_weights_file(tmp_path):
  (tmp_path / "config.json").write_text(json.dumps(hf_io.config_to_hf(get_preset("tiny-llama"))))
  with pytest.raises(FileNotFoundError, match="model.safetensors"):
    hf_io.load_hf_checkpoint(str(tmp_path), load_tokenizer=False)


def _word_tokenizer(n_words: int) -> Tokenizer:
  vocab = {f"w{i}": i for i in range(n_words)} | {"<eos>": n_words}
  backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
  backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  return Tokenizer(backend=backend, eos_ids=(n_words,), pad_id=n_words)


def test_tokenizer_vocab_larger_than_model(ckpt):
  _word_tokenizer(500).save(str(ckpt))  # 501 ids > model vocab 128
  with pytest.raises(ValueError, match=r"501 tokens.*vocab_size is 128"):
    hf_io.load_hf_checkpoint(str(ckpt))


def test_tokenizer_roundtrip_with_checkpoint(ckpt):
  tok = _word_tokenizer(100)
  model, _ = hf_io.load_hf_checkpoint(str(ckpt), load_tokenizer=False)
  hf_io.save_hf_checkpoint(model, str(ckpt), tokenizer=tok)
  _, loaded = hf_io.load_hf_checkpoint(str(ckpt))
  assert loaded.eos_ids == (100,) and loaded.pad_id == 100
  assert loaded.decode(loaded.encode("w3 w7 w99")) == "w3 w7 w99"
  gen = json.loads((ckpt / "generation_config.json").read_text())
  assert gen["eos_token_id"] == [100]
  assert os.path.exists(ckpt / "tokenizer_config.json")
  # transformers reads the same tokenizer files
  import transformers
  hf_tok = transformers.AutoTokenizer.from_pretrained(str(ckpt))
  assert hf_tok.encode("w3 w7", add_special_tokens=False) == loaded.encode("w3 w7")
  assert hf_tok.eos_token_id == 100
  np.testing.assert_array_equal(loaded.encode("w5"), [5])
