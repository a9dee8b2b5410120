#!/usr/bin/env bash
# GPU correctness first, then the numbers, in as few device calls as the 10-minute limit allows:
#   bash benchmarks/gpu_check.sh            # all three stages (~9.5 minutes: tight)
#   bash benchmarks/gpu_check.sh tests      # or one stage per call: tests | profile | bench
# Run from the repository root on the H200; carry the dflash wheel (.whl/, see the device
# README). Timeouts keep each stage inside its share of a call.
set -u
stage=${1:-all}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD:$PWD/benchmarks
quiet() { grep -Ev "warn|Warn"; }
if [ "$stage" = all ] || [ "$stage" = tests ]; then
  echo "== graphs, fast path, losslessness on the GPU"
  timeout 220 python -m pytest -q -x -p no:cacheprovider tests/test_cuda_graphs.py \
    tests/test_inference_fusion.py --tb=short 2>&1 | quiet | tail -8
fi
if [ "$stage" = all ] || [ "$stage" = profile ]; then
  echo "== where the batch-1 decode step goes"
  timeout 100 python benchmarks/profile_decode_xs.py --top 12 2>&1 | quiet | tail -30
fi
if [ "$stage" = all ] || [ "$stage" = bench ]; then
  echo "== XS-2.1 size: floor, DFlash steps, variants, simulated acceptance"
  timeout 240 python benchmarks/bench_gpu_xs.py --new-tokens 32 --variants --profile 2>&1 \
    | quiet | tail -60
fi
