"""Test setup: 8 fake CPU devices for sharding tests, fp32 matmuls for parity."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# No persistent XLA cache in tests (train.main would turn it on): a program loaded from
# disk is not compiled, and the tests count compiles.
os.environ["SPEC_RL_JAX_XLA_CACHE"] = ""

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
