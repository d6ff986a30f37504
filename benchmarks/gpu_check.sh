#!/usr/bin/env bash
# The GPU check (pagedllm/bench/gpu_check.py): HF parity on the device, the Triton kernels against the torch
# reference on Llama-3-8B shapes, the 8B-shaped decode step against its HBM floor, the small model's step,
# throughput of 256 mixed requests, and the seed's 13B case in 80 GB. Under 8 minutes on one H200.
# Run from the repository root on a machine with torch, triton and transformers; wheels of the other packages
# the project needs may be carried in .whl/ (installed to /tmp/site first). Results: $OUT/gpu_check.json
# (or ./gpu_check.json), and each section's JSON on stdout as it ends.
set -euo pipefail
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -m pagedllm.bench.gpu_check --device cuda --out "${OUT:-.}/gpu_check.json" "$@"
