#!/usr/bin/env bash
# The GPU check, in at most 8 minutes on one GPU, writing 8 files into one folder:
#   1. the CUDA tests (tests/compiled/test_cuda.py): cuda-tests.xml, cuda-tests.log;
#   2. benchmarks/gpu_check.py: GPT-2 small through the compiled and eager lowerings
#      against the nanoGPT-style reference (tokens/s, MFU, memory, compile time), the
#      checkpoint stall, the guard's cost: throughput.json, checkpoint_stall.json,
#      guard.json, gpu_check.log;
#   3. a second start of `sexpgpu run examples/gpt2-small.sx` on the compile caches
#      step 2 filled (the warm start): start.json;
#   4. summary.json: the exit status and what was written.
# The compile caches live in a temporary folder, not among the results.
#
#   RESULTS_DIR=/tmp/gpu benchmarks/gpu_check.sh             # on a GPU machine
#   RESULTS_DIR=/tmp/gpu benchmarks/gpu_check.sh --cpu-smoke  # every path, on the CPU, at toy size
set -euo pipefail
cd "$(dirname "$0")/.."
RESULTS_DIR="${RESULTS_DIR:-./gpu-results}"
mkdir -p "$RESULTS_DIR"
PYTHON="${PYTHON:-python}"
[ -x .venv/bin/python ] && PYTHON=.venv/bin/python
SMOKE=()
DEVICE=(--device cuda)
KNOBS=()
if [ "${1:-}" = "--cpu-smoke" ]; then
  SMOKE=(--cpu-smoke)
  DEVICE=(--device cpu --lowering compiled)
  KNOBS=(--set dim=64 --set layers=2 --set heads=2 --set context=64 --set batch=2)
fi
SCRATCH="$(mktemp -d "${TMPDIR:-/tmp}/sexpgpu-gpu-check-XXXXXX")"
trap 'rm -rf "$SCRATCH"' EXIT
export TORCHINDUCTOR_CACHE_DIR="$SCRATCH/torch-cache"
[ -f examples/gpt2-tokens.bin ] || "$PYTHON" examples/make_gpt2_tokens.py

status=0
timeout 180 "$PYTHON" -m pytest -q -rs tests/compiled/test_cuda.py \
  --junitxml="$RESULTS_DIR/cuda-tests.xml" >"$RESULTS_DIR/cuda-tests.log" 2>&1 || status=$?
tail -n 3 "$RESULTS_DIR/cuda-tests.log"
timeout 300 "$PYTHON" benchmarks/gpu_check.py --results "$RESULTS_DIR" "${SMOKE[@]}" \
  2>"$RESULTS_DIR/gpu_check.log" || status=$?
# The warm second start: the graphs gpu_check.py compiled are in the caches now.
started=$(date +%s.%N)
timeout 120 "$PYTHON" -m sexpgpu_cli run examples/gpt2-small.sx "${DEVICE[@]}" "${KNOBS[@]}" \
  --steps 2 --metrics-dir "$SCRATCH/m" --log-format json 2>"$SCRATCH/start.log" || status=$?
ended=$(date +%s.%N)
"$PYTHON" - "$RESULTS_DIR" "$status" "$SCRATCH/start.log" "$started" "$ended" <<'PY'
import json, pathlib, sys
folder, status = pathlib.Path(sys.argv[1]), int(sys.argv[2])
lines = [json.loads(l) for l in pathlib.Path(sys.argv[3]).read_text().splitlines() if l.startswith("{")]
began = next((l for l in lines if l.get("event") in ("run started", "run resumed")), {})
start = {"wall_seconds": float(sys.argv[5]) - float(sys.argv[4]),
         "compile_seconds": began.get("compile_seconds"), "goal": "wall_seconds <= 5"}
(folder / "start.json").write_text(json.dumps(start, indent=2))
found = sorted(p.name for p in folder.iterdir())
summary = {"exit_status": status, "files": found + ["summary.json"]}
(folder / "summary.json").write_text(json.dumps(summary, indent=2))
print(json.dumps({**summary, "start": start}))
PY
exit "$status"
