#!/bin/sh
# The data-parallel tests on a machine with CUDA devices: NCCL ranks, one device each.
# Needs 3 devices for the three-rank test (2 for the rest):
#   sh tests/distributed/gpu_check.sh
set -eu
cd "$(dirname "$0")/../.."
SEXPGPU_DP_TEST_DEVICE=cuda exec python -m pytest -q -p no:randomly tests/distributed "$@"
