"""Test setup: 8 fake CPU devices for sharding tests, fp32 matmuls for parity."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The trainer's persistent XLA cache (train.main turns it on) would write into the
# user's model cache; tests that want one point it at a temporary directory.
os.environ["SPEC_RL_JAX_XLA_CACHE"] = ""

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
