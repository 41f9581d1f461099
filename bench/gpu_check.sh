#!/usr/bin/env bash
# The GPU checks, as one script for the device machine (see ../shared/device/README.md):
# the gpu-marked tests, then the GPU benchmarks, with logs and JSON under $OUT.
# There: python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#          --target .site .whl/*.whl && export PYTHONPATH=$PWD/.site:$PWD && bash bench/gpu_check.sh
set -uo pipefail
OUT=${OUT:-/tmp/grctl-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-$PWD}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
timeout 240 python3 -m pytest -q -m gpu tests 2>&1 | tee "$OUT/gpu_tests.log"
timeout 180 python3 bench/bench_generate.py --preset gpu --repeats 3 > "$OUT/bench_generate_gpu.json" \
  2> "$OUT/bench_generate_gpu.err"
echo "done: $(ls "$OUT")"
