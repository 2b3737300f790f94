#!/usr/bin/env bash
# The GPU check of the compiled lowering, in at most 8 minutes on one GPU:
#   1. the CUDA tests (tests/compiled/test_cuda.py: bf16 training, recorded CUDA
#      choices, bit-exact resume on the GPU, pinned snapshots), as JUnit XML;
#   2. benchmarks/gpu_check.py: GPT-2 small tokens/s against hand-written eager and
#      torch.compile, checkpoint stall against a plain pinned copy, the guard's cost.
# Results: JSON (and the tests' XML and logs) under $RESULTS_DIR (default ./gpu-results).
#
#   RESULTS_DIR=/tmp/gpu benchmarks/gpu_check.sh            # on a GPU machine
#   RESULTS_DIR=/tmp/gpu benchmarks/gpu_check.sh --cpu-smoke # the CPU-side parts, here
set -euo pipefail
cd "$(dirname "$0")/.."
RESULTS_DIR="${RESULTS_DIR:-./gpu-results}"
mkdir -p "$RESULTS_DIR"
PYTHON="${PYTHON:-python}"
[ -x .venv/bin/python ] && PYTHON=.venv/bin/python
SMOKE=()
[ "${1:-}" = "--cpu-smoke" ] && SMOKE=(--cpu-smoke)
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$RESULTS_DIR/torch-cache}"
[ -f examples/gpt2-tokens.bin ] || "$PYTHON" examples/make_gpt2_tokens.py

status=0
timeout 180 "$PYTHON" -m pytest -q -p no:randomly -rs tests/compiled/test_cuda.py \
  --junitxml="$RESULTS_DIR/cuda-tests.xml" >"$RESULTS_DIR/cuda-tests.log" 2>&1 || status=$?
tail -n 3 "$RESULTS_DIR/cuda-tests.log"
timeout 300 "$PYTHON" benchmarks/gpu_check.py --results "$RESULTS_DIR" "${SMOKE[@]}" \
  2>"$RESULTS_DIR/gpu_check.log" || status=$?
"$PYTHON" - "$RESULTS_DIR" "$status" <<'PY'
import json, pathlib, sys
folder, status = pathlib.Path(sys.argv[1]), int(sys.argv[2])
found = sorted(p.name for p in folder.glob("*.json"))
summary = {"exit_status": status, "files": found}
(folder / "summary.json").write_text(json.dumps(summary, indent=2))
print(json.dumps(summary))
PY
exit "$status"
