#!/usr/bin/env bash
# One call on the GPU machine: install the project, run the GPU tests and the benchmarks, keep the logs.
#   bash benchmarks/device.sh [tests] [kernels] [hf] [gptfast] [serve]     (default: all)
# Logs go to $OUT (the device tool's output folder) or benchmarks/results/raw when unset.
# Carry `.whl` (expecttest) and `.device/peers` (FlashInfer) with the call: ../shared/device/README.md.
set -uo pipefail
out=${OUT:-benchmarks/results/raw}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1 || ls .device/peers/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl .device/peers/*.whl 2>/dev/null \
    || python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null || exit 1
parts=${*:-tests kernels hf gptfast serve}
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())" | tee "$out/versions.txt"
for part in $parts; do
  echo "=== $part $(date -u +%H:%M:%S)"
  case $part in
    tests) python3 -m pytest -q -p no:cacheprovider -n 8 tests 2>&1 | tee "$out/gpu-tests.log" | tail -25 ;;
    kernels) python3 -m b12x_inductor.bench --out "$out/kernels.json" 2>&1 | tee "$out/bench-kernels.log" ;;
    *) python3 -m b12x_inductor.bench "$part" --quick --out "$out/$part.json" 2>&1 | tee "$out/bench-$part.log" ;;
  esac
done
