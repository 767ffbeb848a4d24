"""XManager launcher: a recipe on a multi-host Cloud TPU slice through XManager on Cloud.

  xmanager launch launch/xmanager_launch.py -- --config configs/qwen3_8b_v5p.yaml \
      --image REGISTRY/spec-rl-jax:latest [--tpu v5p-64] [section.field=value ...]

Written against the ``xmanager`` release on PyPI (0.8.5; ``pip install -e ".[launch]"``).
Of its executors only XManager on Cloud's ``xm_cloud.KubernetesJobExecutor`` runs a
multi-host TPU slice: it asks GKE for ``tpu-v5p-slice`` nodes of the requested topology
and starts ``requirements.replicas`` pods, one per host. (``xm_local.Vertex`` maps only
TPU v2/v3 and runs a single replica of its first job; ``xm_local.Kubernetes`` starts one
pod per job with the legacy TPU annotation.)

The experiment is one job group holding one job, the trainer: one replica per TPU host,
every replica the same command, ``python -m spec_rl_jax.train --config RECIPE --resume
[overrides]``. ``policy.distributed: true`` makes each call ``jax.distributed.initialize()``,
which reads the slice's hosts and its own index from the TPU environment GKE provides.
``--resume`` is always passed: on a run directory without a checkpoint the trainer starts
at step 0, and a replica restarted after a failure continues from the last checkpoint
(the JobSet's restart does the same, launch/jobset.yaml). The bucket holding checkpoints
and data is mounted at the recipe's paths (GCS volume).

Before anything is submitted the recipe's memory plan is checked against the slice's chip
(spec_rl_jax/plan.py), and the recipe's mesh must use every chip of the slice.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Sequence

import attr
from absl import app, flags
from xmanager import xm
from xmanager import xm_cloud
from xmanager.xm_local import executables
from xmanager_cloud.experiment_state_server.proto import work_unit_pb2

from spec_rl_jax import plan
from spec_rl_jax.config import TrainConfig, load_config

TRAINER = ("python", "-m", "spec_rl_jax.train")


@dataclasses.dataclass(frozen=True)
class Slice:
  """A Cloud TPU slice type: ``xm.ResourceType`` name, topology, chips per host VM."""

  accelerator: str
  topology: str
  chip: str  # a key of plan.CHIPS
  chips_per_host: int = 4

  @property
  def chips(self) -> int:
    return xm.Topology(self.topology).chip_count

  @property
  def hosts(self) -> int:
    return self.chips // self.chips_per_host


# v5p slice names count TensorCores (two per chip): v5p-64 is 32 chips on 8 hosts.
SLICES: dict[str, Slice] = {
    "v5p-8": Slice("tpu_v5p", "2x2x1", "tpu-v5p"),
    "v5p-16": Slice("tpu_v5p", "2x2x2", "tpu-v5p"),
    "v5p-32": Slice("tpu_v5p", "2x2x4", "tpu-v5p"),
    "v5p-64": Slice("tpu_v5p", "2x4x4", "tpu-v5p"),
    "v5p-128": Slice("tpu_v5p", "4x4x4", "tpu-v5p"),
}


@attr.s(auto_attribs=True)
class TrainerImage(executables.GoogleContainerRegistryImage):
  """A prebuilt image (``pip install -e .`` and ``jax[tpu]``) with its command line.

  XManager on Cloud copies an executable's attributes named like fields of its pod spec
  (``ExecutableSpec``) into it: ``command`` and ``args_list`` give the exact argv (its
  ``args`` map holds only ``--key=value`` strings, no positional overrides or bare
  ``--resume``), ``volume_mounts`` the bucket's mount.
  """

  command: list[str] = attr.Factory(list)
  args_list: list[str] = attr.Factory(list)
  volume_mounts: list[work_unit_pb2.VolumeMount] = attr.Factory(list)


@attr.s(auto_attribs=True)
class SliceExecutor(xm_cloud.KubernetesJobExecutor):
  """`xm_cloud.KubernetesJobExecutor` with the pod's volumes (copied by name, as above)."""

  volumes: list[work_unit_pb2.Volume] = attr.ib(kw_only=True, factory=list)


def trainer_args(recipe: str, overrides: Sequence[str] = ()) -> list[str]:
  """Every replica's arguments to ``python -m spec_rl_jax.train``."""
  return ["--config", recipe, "--resume", *overrides]


def check_recipe(cfg: TrainConfig, tpu: str) -> Slice:
  """The slice ``tpu``, after checking that ``cfg``'s mesh uses all of its chips and that
  a multi-host slice runs with ``policy.distributed``."""
  if tpu not in SLICES:
    raise ValueError(f"unknown TPU slice {tpu!r}; known: {', '.join(SLICES)}")
  tpu_slice = SLICES[tpu]
  if math.prod(cfg.policy.mesh) != tpu_slice.chips:
    raise ValueError(f"policy.mesh {list(cfg.policy.mesh)} uses {math.prod(cfg.policy.mesh)}"
                     f" chips; a {tpu} slice has {tpu_slice.chips}")
  if tpu_slice.hosts > 1 and not cfg.policy.distributed:
    raise ValueError(f"a {tpu} slice has {tpu_slice.hosts} hosts: set policy.distributed=true")
  return tpu_slice


def build_job_group(recipe: str, image: str, tpu: str = "v5p-64",
                    overrides: Sequence[str] = (), bucket: str = "spec-rl",
                    mount: str = "/gcs/spec-rl") -> xm.JobGroup:
  """The experiment's job group for ``recipe`` on a ``tpu`` slice, without launching:
  one trainer job, one replica per host of the slice."""
  tpu_slice = check_recipe(load_config(recipe, overrides), tpu)
  requirements = xm.JobRequirements({tpu_slice.accelerator: tpu_slice.topology},
                                    replicas=tpu_slice.hosts)
  executable = TrainerImage(
      name="trainer", image_path=image, command=list(TRAINER),
      args_list=trainer_args(recipe, overrides),
      volume_mounts=[work_unit_pb2.VolumeMount(name="gcs", mount_path=mount)])
  volumes = [work_unit_pb2.Volume(name="gcs", gcs=work_unit_pb2.GcsVolumeSource(bucket=bucket))]
  return xm.JobGroup(trainer=xm.Job(executable=executable, name="trainer",
                                    executor=SliceExecutor(requirements=requirements,
                                                           volumes=volumes)))


_CONFIG = flags.DEFINE_string("config", "configs/qwen3_8b_v5p.yaml", "the recipe")
_IMAGE = flags.DEFINE_string("image", None, "the trainer's container image", required=True)
_TPU = flags.DEFINE_enum("tpu", "v5p-64", list(SLICES), "the TPU slice type")
_BUCKET = flags.DEFINE_string("bucket", "spec-rl", "GCS bucket of checkpoints and data")
_MOUNT = flags.DEFINE_string("mount", "/gcs/spec-rl", "where the bucket is mounted")


def main(argv: list[str]) -> None:
  overrides = argv[1:]
  cfg = load_config(_CONFIG.value, overrides)
  chip = plan.CHIPS[check_recipe(cfg, _TPU.value).chip]
  memory = plan.plan(cfg, chip.usable, chip.label)
  print(memory.table())
  if not memory.fits:
    raise plan.PlanError(memory.error())
  group = build_job_group(_CONFIG.value, _IMAGE.value, _TPU.value, overrides, _BUCKET.value,
                          _MOUNT.value)
  with xm_cloud.create_experiment(experiment_title=f"spec-rl-jax {_CONFIG.value}") as experiment:
    experiment.add(group)


if __name__ == "__main__":
  app.run(main, argv=sys.argv)
