#!/usr/bin/env bash
# The GPU checks, as one script for the device machine (see docs/benchmarks.md): the gpu-marked
# tests, graphs vs eager, mixed decode batches (the ragged layout) against their requests
# alone, the prefix cache against no cache, generation at the GR shapes (beam 256 at context
# 5,000: req/s), colocated CUDA IPC syncs of the 1.7B and 8B shapes (pause to continue) and disk
# load, all in
# bench/gpu_smoke.py (at most 6.5 minutes; the whole script under 8), with its JSON and log under
# $OUT. Its random Qwen3 1.7B- and 8B-shaped models are built on the device: no downloads.
# There, first install the server wheels that machine lacks (prepared here into .whl/):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#     --target .site .whl/*.whl && export PYTHONPATH=$PWD/.site:$PWD && bash bench/gpu_check.sh
set -uo pipefail
OUT=${OUT:-$(mktemp -d)}
export OUT PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-$PWD}
nvidia-smi --query-gpu=name,uuid,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
timeout 410 python3 bench/gpu_smoke.py 2>&1 | tee "$OUT/gpu_smoke.log"
# stochastic vs deterministic beam 64, and beam selection's share of a step at 128 requests
timeout 50 python3 bench/bench_search.py --device cuda --repeats 5 > "$OUT/bench_search.json"
echo "done: $(ls "$OUT")"
