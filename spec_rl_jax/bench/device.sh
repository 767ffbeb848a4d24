#!/usr/bin/env bash
# The accelerator check of an install, offline, in about 8 minutes on one GPU (or TPU):
# a few steps of the default recipe through `python -m spec_rl_jax.train`, then
# bench.rollout, bench.spec and bench.kernels at their --quick sizes, each writing its
# JSON (and table, plots) into one folder.
#
#   bash spec_rl_jax/bench/device.sh [OUT_DIR]      (default: bench_device/<timestamp>)
#
# Needs the `test` extra (bench.rollout and bench.spec time `transformers` beside us)
# and the default models in $SPEC_RL_JAX_CACHE (`python -m spec_rl_jax.sft` puts them
# there; the train step makes them first when absent, which takes longer than the rest).
# DRY_RUN=1 prints the commands without running them.
set -euo pipefail

out="${1:-bench_device/$(date +%Y%m%d-%H%M%S)}"
steps="${TRAIN_STEPS:-4}"

# stage NAME COMMAND...: runs it, its output also in OUT/NAME.log, its time in times.txt.
stage() {
  local name=$1 start=$SECONDS
  shift
  if [ -n "${DRY_RUN:-}" ]; then
    echo "$*"
    return
  fi
  echo "== $name: $*"
  "$@" 2>&1 | tee "$out/$name.log"
  echo "$name $((SECONDS - start)) s" | tee -a "$out/times.txt"
}

if [ -z "${DRY_RUN:-}" ]; then
  mkdir -p "$out"
  export PYTHONUNBUFFERED=1
  python -c "import jax; print('jax', jax.__version__, jax.default_backend(), jax.devices())" \
    | tee "$out/devices.txt"
  : > "$out/times.txt"
fi
stage train python -m spec_rl_jax.train "run_dir=$out/train" "steps=$steps" \
  "checkpoint.every=$steps" data.eval_n=16 data.eval_every=0 progress=false
stage rollout python -m spec_rl_jax.bench.rollout --quick --out "$out/rollout.json"
stage spec python -m spec_rl_jax.bench.spec --quick --out "$out/spec.json"
stage kernels python -m spec_rl_jax.bench.kernels --quick --out "$out/kernels.json"
[ -n "${DRY_RUN:-}" ] || echo "results in $out: $(cd "$out" && ls -- *.json | tr '\n' ' ')"
