"""The launchers against the recipe they launch: launch/jobset.yaml (parses; topology,
chips and pods match the recipe's mesh; the resume flag) and launch/xmanager_launch.py
(its job objects for v5p-64 built with the xmanager release from PyPI, without
launching; skipped where the ``launch`` extra is not installed)."""

import importlib.util
import math
import os
import re
import subprocess
import sys

import pytest
import yaml

from spec_rl_jax import checkpoint
from spec_rl_jax.config import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = "configs/qwen3_8b_v5p.yaml"
CHIPS_PER_HOST = 4  # TPU v5p


@pytest.fixture(scope="module")
def recipe():
  return load_config(os.path.join(ROOT, RECIPE))


@pytest.fixture(scope="module")
def jobset():
  with open(os.path.join(ROOT, "launch", "jobset.yaml")) as f:
    return yaml.safe_load(f)


def _pod(jobset):
  [workers] = jobset["spec"]["replicatedJobs"]
  return workers, workers["template"]["spec"]["template"]


def test_jobset_matches_the_recipes_mesh(jobset, recipe):
  assert (jobset["apiVersion"], jobset["kind"]) == ("jobset.x-k8s.io/v1alpha2", "JobSet")
  assert jobset["metadata"]["annotations"][
      "alpha.jobset.sigs.k8s.io/exclusive-topology"] == "cloud.google.com/gke-nodepool"
  workers, pod = _pod(jobset)
  job = workers["template"]["spec"]
  selector = pod["spec"]["nodeSelector"]
  assert selector["cloud.google.com/gke-tpu-accelerator"] == "tpu-v5p-slice"
  assert recipe.plan.chip == "tpu-v5p"
  chips = math.prod(int(n) for n in selector["cloud.google.com/gke-tpu-topology"].split("x"))
  assert chips == math.prod(recipe.policy.mesh) == 32
  [container] = pod["spec"]["containers"]
  per_pod = container["resources"]["limits"]["google.com/tpu"]
  assert per_pod == CHIPS_PER_HOST
  assert workers["replicas"] == 1 and job["parallelism"] == job["completions"] == chips // per_pod
  assert recipe.policy.distributed  # one process per pod, joined by jax.distributed
  assert jobset["spec"]["failurePolicy"]["maxRestarts"] > 0


def test_jobset_runs_the_recipe_with_its_paths_mounted(jobset, recipe):
  _, pod = _pod(jobset)
  [container] = pod["spec"]["containers"]
  [script] = container["args"]
  assert re.search(rf"python -m spec_rl_jax\.train --config {re.escape(RECIPE)}\b", script)
  [mount] = container["volumeMounts"]
  [volume] = [v for v in pod["spec"]["volumes"] if v["name"] == mount["name"]]
  assert volume["csi"]["driver"] == "gcsfuse.csi.storage.gke.io"
  assert pod["metadata"]["annotations"]["gke-gcsfuse/volumes"] == "true"
  root = mount["mountPath"] + "/"
  data_files = [s.split(":", 1)[1].split("?")[0] for s in recipe.data.sources]
  for path in (recipe.run_dir, recipe.policy.path, recipe.drafter.options.path, *data_files):
    assert path.startswith(root), path


def _trainer_argv(script: str, run_dir: str) -> list[str]:
  """What the pod's script runs, with ``python`` stubbed to print its arguments."""
  stub = 'python() { printf "%s\\n" "$@"; }; '
  out = subprocess.run(["bash", "-c", stub + script.replace("RUN_DIR", run_dir)],
                       capture_output=True, text=True, check=True).stdout
  return out.split()


def test_jobset_resumes_once_run_dir_holds_a_checkpoint(jobset, recipe, tmp_path):
  _, pod = _pod(jobset)
  [script] = pod["spec"]["containers"][0]["args"]
  probe = f"{recipe.run_dir}/{checkpoint.CKPT_DIR}"
  assert f"ls {probe} " in script  # the trainer's checkpoint directory of the recipe's run
  script = script.replace(recipe.run_dir, "RUN_DIR")
  fresh = _trainer_argv(script, str(tmp_path))
  assert fresh == ["-m", "spec_rl_jax.train", "--config", RECIPE]
  (tmp_path / checkpoint.CKPT_DIR).mkdir()
  assert _trainer_argv(script, str(tmp_path)) == fresh + ["--resume"]


# --------------------------------------------------------------------------- XManager


@pytest.fixture(scope="module")
def launcher():
  pytest.importorskip("xmanager", reason="the launch extra: pip install -e '.[launch]'")
  if "xmanager_launch" not in sys.modules:  # its absl flags may be defined once only
    spec = importlib.util.spec_from_file_location(
        "xmanager_launch", os.path.join(ROOT, "launch", "xmanager_launch.py"))
    sys.modules["xmanager_launch"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sys.modules["xmanager_launch"])
  return sys.modules["xmanager_launch"]


def test_xmanager_job_group_for_v5p_64(launcher, recipe, jobset):
  from xmanager import xm  # noqa: PLC0415
  from xmanager.xm_cloud import experiment  # noqa: PLC0415

  group = launcher.build_job_group(os.path.join(ROOT, RECIPE), "gcr.io/p/spec-rl-jax:1",
                                   overrides=["learner.lr=2e-6"])
  [(name, job)] = group.jobs.items()
  req = job.executor.requirements
  assert name == "trainer" and req.accelerator == xm.ResourceType.TPU_V5P
  assert req.topology.chip_count == math.prod(recipe.policy.mesh) == 32
  assert req.replicas == 32 // CHIPS_PER_HOST == 8
  assert job.executable.command == ["python", "-m", "spec_rl_jax.train"]
  assert job.executable.args_list == ["--config", os.path.join(ROOT, RECIPE), "--resume",
                                      "learner.lr=2e-6"]
  # XManager on Cloud's own conversion of the job group into the pods it asks GKE for.
  [k8s] = experiment._convert_job_group_to_ess_job_set(group, {})
  assert (k8s.spec.resources.tpu_resources.type, k8s.spec.resources.tpu_resources.topology,
          k8s.replicas) == ("tpu-v5p-slice", "2x4x4", 8)
  assert list(k8s.spec.command) + list(k8s.spec.args_list) == [
      *job.executable.command, *job.executable.args_list]
  # The same slice, pods and bucket as the JobSet.
  workers, pod = _pod(jobset)
  assert pod["spec"]["nodeSelector"] == {
      "cloud.google.com/gke-tpu-accelerator": k8s.spec.resources.tpu_resources.type,
      "cloud.google.com/gke-tpu-topology": k8s.spec.resources.tpu_resources.topology}
  assert workers["template"]["spec"]["parallelism"] == k8s.replicas
  [mount] = pod["spec"]["containers"][0]["volumeMounts"]
  assert k8s.spec.volume_mounts[0].mount_path == mount["mountPath"]
  assert k8s.volumes[0].gcs.bucket == pod["spec"]["volumes"][0]["csi"]["volumeAttributes"][
      "bucketName"]


@pytest.mark.parametrize("overrides, message", [
    (["policy.mesh=[1,8,8]"], r"uses 64 chips; a v5p-64 slice has 32"),
    (["policy.distributed=false"], r"8 hosts: set policy.distributed=true"),
])
def test_xmanager_refuses_a_recipe_that_does_not_match_the_slice(launcher, overrides, message):
  with pytest.raises(ValueError, match=message):
    launcher.build_job_group(os.path.join(ROOT, RECIPE), "img", overrides=overrides)
