#!/usr/bin/env bash
# One device call (about 9 minutes of the 10 allowed): GPU correctness first, then the numbers.
#   bash benchmarks/gpu_check.sh            # on the H200, from the repository root
# Carry the dflash wheel (.whl/, see /work/.library/device/README.md); PYTHONPATH is set here.
set -u
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD:$PWD/benchmarks
echo "== graphs, fast path, losslessness on the GPU"
timeout 260 python -m pytest -q -x -p no:cacheprovider tests/test_cuda_graphs.py \
  tests/test_inference_fusion.py --tb=short 2>&1 | grep -Ev "warn|Warn" | tail -8
echo "== where the batch-1 decode step goes"
timeout 100 python benchmarks/profile_decode_xs.py --top 12 2>&1 | grep -Ev "warn|Warn" | tail -30
echo "== XS-2.1 size: floor, DFlash steps, variants, simulated acceptance"
timeout 180 python benchmarks/bench_gpu_xs.py --new-tokens 32 --variants --profile 2>&1 \
  | grep -Ev "warn|Warn" | tail -60
