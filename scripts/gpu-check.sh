#!/usr/bin/env bash
# The GPU check (benchmarks/gpu_check.py; docs/benchmarks.md, "GPU check"): every GPU-specific path of
# rlfleet measured on one GPU in one run, under 8 minutes on an H100/H200 class GPU, nothing downloaded
# from a model hub (the model is built in code).
#
#   scripts/gpu-check.sh [--dry-run] [--out DIR] [benchmarks/gpu_check.py options]
#
# --dry-run: a tiny model on the CPU (CI runs this: tests/core/test_gpu_check.py), so every step runs
# where no GPU is. --out DIR: where gpu-check.json and gpu-check.log go (default: .gpu-check/).
#
# A GPU machine may start bare. The check needs rlfleet's Python dependencies and, for its vLLM rows,
# vLLM's CUDA build (which brings the torch it is built against). Each is installed only when missing:
#   - rlfleet's dependencies: from wheels in .whl/ (carried to a machine that reaches no package
#     registry) into a private target directory put on PYTHONPATH, leaving the machine's own packages
#     alone; else from PyPI when it answers within 5 s;
#   - vLLM, when PyPI answers: into a virtual environment that sees the system's packages
#     (RLFLEET_GPU_CHECK_VLLM=0 skips it);
#   - else the vLLM rows are skipped, and the JSON says why.
# Install and check times are printed separately.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=.gpu-check
ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT="$2"; shift 2 ;;
    *) ARGS+=("$1"); shift ;;
  esac
done
mkdir -p "$OUT"
PY=${PYTHON:-python3}
if [ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ]; then PY=.venv/bin/python; fi
t0=$(date +%s)

if ! "$PY" -c 'import pydantic, redis, cryptography, zstandard' 2>/dev/null; then
  if compgen -G ".whl/*.whl" >/dev/null; then
    SITE=${RLFLEET_GPU_CHECK_SITE:-/tmp/rlfleet-gpu-check-site}
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  elif timeout 5 curl -sfI https://pypi.org/simple/pip/ >/dev/null 2>&1; then
    "$PY" -m pip install -q pydantic pyyaml redis requests cryptography prometheus-client zstandard aiohttp
  fi
fi
if [[ " ${ARGS[*]:-} " != *" --dry-run "* ]] && [ "${RLFLEET_GPU_CHECK_VLLM:-1}" != 0 ] \
  && ! "$PY" -c 'import vllm' 2>/dev/null && timeout 5 curl -sfI https://pypi.org/simple/vllm/ >/dev/null 2>&1; then
  VENV=/tmp/rlfleet-gpu-check-vllm
  "$PY" -m venv --system-site-packages "$VENV"
  "$VENV/bin/pip" install -q 'vllm==0.32.0'
  PY="$VENV/bin/python"
fi
t1=$(date +%s)
echo "install: $((t1 - t0)) s"

set -o pipefail
PYTHONUNBUFFERED=1 "$PY" benchmarks/gpu_check.py --json "$OUT/gpu-check.json" "${ARGS[@]}" 2>&1 | tee "$OUT/gpu-check.log"
echo "check: $(($(date +%s) - t1)) s; figures in $OUT/gpu-check.json"
