"""Where compiled programs persist (`use_persistent_cache`), and compile counting."""

import os
import threading

import jax
import jax.numpy as jnp
import pytest

from spec_rl_jax.compiles import CompileCounter, use_persistent_cache


@pytest.fixture
def no_cache_dir():
  before = jax.config.jax_compilation_cache_dir
  jax.config.update("jax_compilation_cache_dir", None)
  yield
  jax.config.update("jax_compilation_cache_dir", before)


def test_persistent_cache_directory(no_cache_dir, monkeypatch, tmp_path):
  monkeypatch.setenv("SPEC_RL_JAX_XLA_CACHE", "")  # off
  assert use_persistent_cache() is None and jax.config.jax_compilation_cache_dir is None
  monkeypatch.delenv("SPEC_RL_JAX_XLA_CACHE")  # default: next to the models
  monkeypatch.setenv("SPEC_RL_JAX_CACHE", str(tmp_path / "models"))
  want = os.path.join(tmp_path, "models", "xla")
  assert use_persistent_cache() == want == jax.config.jax_compilation_cache_dir
  jax.config.update("jax_compilation_cache_dir", str(tmp_path / "mine"))  # the user's wins
  monkeypatch.setenv("SPEC_RL_JAX_XLA_CACHE", str(tmp_path / "other"))
  assert use_persistent_cache() == str(tmp_path / "mine")


def test_compile_counter_counts_compiles_and_their_seconds():
  f = jax.jit(lambda x: jnp.tanh(x) @ x.T)
  x = jnp.ones((32, 32))
  with CompileCounter() as first:
    f(x).block_until_ready()
  with CompileCounter() as again:
    f(x).block_until_ready()
  assert first.count == 1 and first.seconds > 0
  assert again.count == 0 and again.seconds == 0


def test_compile_counter_counts_its_own_threads_compiles_only():
  """Async RL compiles on two threads at once: each phase's counter sees its own."""
  f = jax.jit(lambda x: jnp.sin(x) @ x.T - 1.0)
  g = jax.jit(lambda x: jnp.exp(x) @ x.T + 2.0)
  x = jnp.ones((16, 16))
  entered, done = threading.Barrier(2), threading.Event()
  other = {}

  def in_other_thread():
    with CompileCounter() as c:
      entered.wait()
      g(x).block_until_ready()
    other["count"] = c.count
    done.set()

  thread = threading.Thread(target=in_other_thread)
  thread.start()
  with CompileCounter() as mine:
    entered.wait()
    done.wait(timeout=60)  # the other thread's compile happens while this counter is open
    f(x).block_until_ready()
  thread.join(timeout=60)
  assert mine.count == 1 and other["count"] == 1


def test_compile_counter_counts_persistent_cache_loads(tmp_path):
  """A program loaded from the persistent cache is built all the same: counted (so a
  "nothing compiled" assertion cannot pass because the cache answered)."""
  from jax.experimental.compilation_cache import compilation_cache as cc
  before = (jax.config.jax_compilation_cache_dir,
            jax.config.jax_persistent_cache_min_compile_time_secs)
  f = jax.jit(lambda x: jnp.cos(x) @ x.T + 3.0)
  x = jnp.ones((24, 24))
  cc.reset_cache()
  jax.config.update("jax_compilation_cache_dir", str(tmp_path))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # keep even this one
  try:
    with CompileCounter() as compiled:
      f(x).block_until_ready()
    jax.clear_caches()  # forget the in-memory executable: the next call reads the disk
    with CompileCounter() as loaded:
      f(x).block_until_ready()
    with CompileCounter() as warm:
      f(x).block_until_ready()
  finally:
    cc.reset_cache()
    jax.config.update("jax_compilation_cache_dir", before[0])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", before[1])
  assert os.listdir(tmp_path)  # the program was written
  assert compiled.count == loaded.count == 1 and warm.count == 0
