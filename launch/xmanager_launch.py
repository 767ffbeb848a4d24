"""XManager launcher for a recipe on a Cloud TPU slice (multi-host via jax.distributed).

  xmanager launch launch/xmanager_launch.py -- --config configs/qwen3_8b_v5p.yaml \
      --tpu v5p-64 [--resume] [section.field=value ...]

Every host runs the same command; ``policy.distributed: true`` in the recipe makes the
trainer call ``jax.distributed.initialize()``, which reads the slice topology from the
TPU runtime.
"""

from __future__ import annotations

import sys

from absl import app, flags
from xmanager import xm, xm_local

_CONFIG = flags.DEFINE_string("config", "configs/qwen3_8b_v5p.yaml", "recipe")
_TPU = flags.DEFINE_string("tpu", "v5p-64", "TPU slice type")
_RESUME = flags.DEFINE_bool("resume", False, "continue run_dir from its checkpoint")


def main(argv: list[str]) -> None:
  overrides = argv[1:]
  args = ["--config", _CONFIG.value, *(["--resume"] if _RESUME.value else []), *overrides]
  with xm_local.create_experiment(experiment_title="spec-rl-jax") as experiment:
    [executable] = experiment.package([xm.python_container(
        executor_spec=xm_local.Vertex.Spec(), path=".", base_image="python:3.11",
        entrypoint=xm.ModuleName("spec_rl_jax.train"))])
    experiment.add(xm.Job(
        executable=executable,
        executor=xm_local.Vertex(requirements=xm.JobRequirements(
            **{_TPU.value.split("-")[0]: int(_TPU.value.split("-")[1])})),
        args=args))


if __name__ == "__main__":
  app.run(main, argv=sys.argv)
