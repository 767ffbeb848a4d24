"""The one command that produces the default policy and draft (tiny sizes, few steps)."""

import json
import os

import transformers

from spec_rl_jax import sft

TINY_ARGS = ["--steps", "4", "--batch_size", "4", "--eval_n", "3", "--no_progress",
             "--model_overrides", "embed_dim=32", "mlp_dim=64", "num_layers=1",
             "num_heads=2", "num_kv_heads=1", "head_dim=16"]


def test_one_command_produces_policy_and_draft(tmp_path, monkeypatch, capsys):
  monkeypatch.setenv("SPEC_RL_JAX_CACHE", str(tmp_path))
  monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # main() adds flags
  sft.main(TINY_ARGS)
  assert "wall time" in capsys.readouterr().out
  for name in ("policy", "draft"):
    files = set(os.listdir(tmp_path / name))
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= files
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / name)
    assert hf.config.architectures == ["Qwen3ForCausalLM"]
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / name).eos_token == (
        "<|endoftext|>")
  report = json.loads((tmp_path / "report.json").read_text())
  for m in report["models"].values():
    assert set(m["accuracy"]) == {"multiplication"} and m["params"] > 0
    assert m["resumed_from"] == 0
  # Built with overrides by this release: the user's choice, not an older recipe.
  assert sft.stale_targets(["policy", "draft"]) == []
  # Rerunning resumes every target at its last step: nothing is trained again.
  sft.main(TINY_ARGS + ["--eval_n", "0"])
  report = json.loads((tmp_path / "report.json").read_text())
  assert all(m["resumed_from"] == 4 for m in report["models"].values())
