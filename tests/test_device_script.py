"""`spec_rl_jax/bench/device.sh`, the accelerator check users run on a GPU: its commands
(printed by ``DRY_RUN=1``) name modules that exist, flags they accept and config keys
the trainer knows."""

import contextlib
import importlib
import io
import os
import shlex
import subprocess

import pytest

from spec_rl_jax.config import load_config

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "spec_rl_jax", "bench", "device.sh")


def _commands(out_dir):
  text = subprocess.run(["bash", SCRIPT, str(out_dir)], env={**os.environ, "DRY_RUN": "1"},
                        capture_output=True, text=True, check=True).stdout
  return [shlex.split(line) for line in text.splitlines()]


def test_device_script_commands_are_valid(tmp_path):
  commands = _commands(tmp_path / "out")
  modules = [c[2] for c in commands]
  assert modules == ["spec_rl_jax.train", "spec_rl_jax.bench.rollout",
                     "spec_rl_jax.bench.spec", "spec_rl_jax.bench.kernels"]
  assert all(c[:2] == ["python", "-m"] for c in commands)
  train_args = commands[0][3:]
  cfg = load_config(None, train_args)  # unknown keys would raise
  assert cfg.run_dir == str(tmp_path / "out" / "train") and cfg.steps >= 1
  for command in commands[1:]:
    flags = [a for a in command[3:] if a.startswith("--")]
    assert {"--quick", "--out"} <= set(flags)
    assert command[command.index("--out") + 1].startswith(str(tmp_path / "out"))
    help_text = io.StringIO()
    with contextlib.redirect_stdout(help_text), pytest.raises(SystemExit) as exit_:
      importlib.import_module(command[2]).main(["--help"])
    assert exit_.value.code == 0
    for flag in flags:
      assert flag in help_text.getvalue(), (command[2], flag)
