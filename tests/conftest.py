"""Test setup: 8 fake CPU devices for sharding tests, unoptimised backend code (the
suite is compile-bound), fp32 matmuls for parity, a persistent XLA cache for the
session; the speculative tests' shared target and its greedy AR outputs, built once per
session."""

import os
import shutil
import tempfile

# The tests' programs are tiny and compiled once or twice, so the suite's time is mostly
# XLA:CPU code generation: the backend compiles them unoptimised, with the older
# elemental emitters and as one LLVM module (cheaper to build than to run slower).
os.environ["XLA_FLAGS"] = " ".join([
    os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8",
    "--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false",
    "--xla_cpu_parallel_codegen_split_count=1"])
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The trainer's persistent XLA cache (train.main turns it on) would write into the
# user's model cache; tests that want one point it at a temporary directory.
os.environ["SPEC_RL_JAX_XLA_CACHE"] = ""

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
# Engines built by different tests compile many identical programs: with every program
# kept on disk for the session, the repeats are loads instead of compiles.
_XLA_CACHE = tempfile.mkdtemp(prefix="spec_rl_jax_test_xla_")
jax.config.update("jax_compilation_cache_dir", _XLA_CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)

import pytest  # noqa: E402

from tests import spec_fixtures  # noqa: E402


@pytest.fixture(scope="session")
def spec_target(tmp_path_factory):
  """The tiny HF-built target of the speculative-decoding tests."""
  return spec_fixtures.build_target(str(tmp_path_factory.mktemp("spec_target")))


@pytest.fixture(scope="session")
def greedy_ar(spec_target):
  """Greedy AR outputs of `spec_target` on `GREEDY_REQS`: what greedy SD must equal."""
  return spec_fixtures.engine(spec_target, None, 0, 4, sampling=spec_fixtures.GREEDY,
                              eos_ids=(11,)).generate(spec_fixtures.GREEDY_REQS)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
  """Tests marked ``mesh`` keep their programs out of the session cache: the cache's
  `serialize()` of a sharded program can abort the process (docs/benchmarks.md)."""
  if item.get_closest_marker("mesh") is None:
    yield
    return
  before = jax.config.jax_persistent_cache_min_compile_time_secs
  jax.config.update("jax_persistent_cache_min_compile_time_secs", float("inf"))
  try:
    yield
  finally:
    jax.config.update("jax_persistent_cache_min_compile_time_secs", before)


def pytest_unconfigure(config):
  shutil.rmtree(_XLA_CACHE, ignore_errors=True)
