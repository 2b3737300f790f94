#!/bin/sh
# Make the teacher distill.sx reads: train distill-teacher.sx and keep the
# params.safetensors of its last checkpoint. Nothing is downloaded.
#   examples/make_teacher.sh [OUT]     (default: teacher.safetensors beside this script)
# SEXPGPU names the command to run (default: sexpgpu).
set -eu
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-$here/teacher.safetensors}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
${SEXPGPU:-sexpgpu} run "$here/distill-teacher.sx" \
    --checkpoint-dir "$work/checkpoints" --metrics-dir "$work/metrics" --log-every 1000
last=$(ls -d "$work"/checkpoints/step-* | tail -n 1)
cp "$last/params.safetensors" "$out"
echo "make_teacher.sh: wrote $out"
