#!/usr/bin/env bash
# The benchmark on GPU replicas: same command, GPU devices, the `gpu` size preset.
#
#   bash benchmarks/gpu.sh                 # 2 replicas (2 GPUs, or 1 GPU split in two)
#   bash benchmarks/gpu.sh --replicas 4    # any option of `python -m benchmarks.run`
#
# Writes docs/performance/results-gpu.json (+ the generated *-gpu tables and plots), which
# the GPU section of docs/performance.md includes. Refuses to run (exit 1)
# without nvidia-smi, or when TensorFlow sees no GPU (`--require-gpu`), so a CPU figure
# can never land in the GPU section.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"
# One GPU and 2+ replicas: distgrad_course.make_strategy splits the GPU into logical GPUs of
# this many MB each (the default, 4096, is too small for the gpu preset's plain-B step).
export DISTGRAD_GPU_MEMORY_MB="${DISTGRAD_GPU_MEMORY_MB:-24576}"
if ! command -v nvidia-smi >/dev/null 2>&1; then
  echo "benchmarks/gpu.sh: no GPU visible (nvidia-smi not found); this run measures GPU figures only." >&2
  echo "On a GPU machine, install the NVIDIA driver and tensorflow[and-cuda] (docs/guides/gpu.md)." >&2
  exit 1
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
exec "$PY" -m benchmarks.run --require-gpu --preset gpu "$@"
