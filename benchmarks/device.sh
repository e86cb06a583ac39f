#!/usr/bin/env bash
# One call on the GPU machine: install the project, run the GPU tests and the benchmarks, keep the logs.
#   bash benchmarks/device.sh [tests] [kernel-tests] [other-tests] [sanitize] [kernels] [mla] [hf] [gptfast] [serve]
#                             [fi-save]
#   (default: tests kernels hf gptfast serve)
# Logs go to $OUT (the device tool's output folder) or benchmarks/results/raw when unset. The device tool
# brings back at most 8 files from $OUT: past that, everything but the fi-aot parts is packed into
# $OUT/results.tgz.
# Carry `.whl` (expecttest) and `.device/peers` (FlashInfer) with the call: ../shared/device/README.md.
# FlashInfer's JIT builds (2-6 min on a fresh machine): `fi-save` packs the modules this machine built into
# $OUT/fi-aot.tgz.part-* (15 MiB pieces); copy them into .device/fi-aot/ here and carry that folder next time:
# they are unpacked where FlashInfer looks for prebuilt (AOT) modules, flashinfer/data/aot/<name>/<name>.so,
# which it loads without building (session 26: 7 modules carried, 8 MB; the bench's warm step took 0 s).
set -uo pipefail
out=${OUT:-benchmarks/results/raw}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1 || ls .device/peers/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl .device/peers/*.whl 2>/dev/null \
    || python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
if ls .device/fi-aot/fi-aot.tgz.part-* >/dev/null 2>&1 && [ -d /tmp/site/flashinfer ]; then
  mkdir -p /tmp/site/flashinfer/data/aot && cat .device/fi-aot/fi-aot.tgz.part-* | tar xzf - -C /tmp/site/flashinfer/data/aot \
    && echo "FlashInfer prebuilt modules: $(ls /tmp/site/flashinfer/data/aot | wc -l)"
fi
# CuTe DSL (../shared/device/README.md): a call that carries .device/cute2 after one that copied .device/cute1
if [ -d .device/cute2 ] && [ -f /tmp/cute/libs.part.aa ] && [ ! -d /tmp/site/nvidia_cutlass_dsl ]; then
  cat /tmp/cute/libs.part.aa .device/cute2/libs.part.ab > "/tmp/cute/$(cat .device/cute2/libs.name)"
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .device/cute2/*.whl /tmp/cute/*.whl || exit 1
fi
if [ -d /tmp/site/nvidia_cutlass_dsl ]; then
  export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:${PYTHONPATH:-}
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null || exit 1
parts=${*:-tests kernels hf gptfast serve}
sanitizer=/usr/local/cuda/bin/compute-sanitizer
kernel_tests="tests/test_device_values.py tests/test_gpu_fuzz.py tests/test_triton_kernels.py tests/test_cute_kernels.py"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())" | tee "$out/versions.txt"
for part in $parts; do
  echo "=== $part $(date -u +%H:%M:%S)"
  case $part in
    tests) python3 -m pytest -q -p no:cacheprovider -n 8 tests 2>&1 | tee "$out/gpu-tests.log" | tail -25 ;;
    # the kernel families' GPU tests, the out-of-contract calls and the fuzz (summary lines: "gpu fuzz")
    kernel-tests) OMP_NUM_THREADS=1 timeout 560 python3 -m pytest -q -p no:cacheprovider -n 8 -m gpu -rP $kernel_tests 2>&1 \
        | tee "$out/gpu-kernel-tests.log" | grep -E "gpu fuzz|passed|failed|error|Error" | tail -40 ;;
    # the other GPU tests (compile, transformers, serving, substitution)
    other-tests) timeout 560 python3 -m pytest -q -p no:cacheprovider -n 8 -m gpu tests \
        $(for f in $kernel_tests; do echo --ignore=$f; done) 2>&1 | tee "$out/gpu-other-tests.log" | tail -25 ;;
    # compute-sanitizer memcheck over the out-of-contract calls, the kernel tests and a fuzz slice, per family
    # (--report-api-errors no: cuda-python's cuGetProcAddress probes at import return errors by design)
    sanitize) GPU_FUZZ_PER_FAMILY=${GPU_FUZZ_PER_FAMILY:-40} OMP_NUM_THREADS=1 timeout 560 $sanitizer --tool memcheck \
        --report-api-errors no --target-processes all --print-limit 20 python3 -m pytest -q -p no:cacheprovider -m gpu -x $kernel_tests \
        ${SANITIZE_K:+-k "$SANITIZE_K"} 2>&1 | tee "$out/gpu-sanitizer.log" | tail -30 ;;
    kernels) python3 -m b12x_inductor.bench --out "$out" 2>&1 | tee "$out/bench-kernels.log" ;;
    mla) python3 -m b12x_inductor.bench mla --out "$out" 2>&1 | tee "$out/bench-mla.log" ;;
    gptfast) python3 -m b12x_inductor.bench gptfast --out "$out/gptfast.json" 2>&1 | tee "$out/bench-gptfast.log" ;;
    # the FlashInfer modules built here (cached_ops/<name>/<name>.so), in pieces the device tool brings back
    fi-save) (cd ~/.cache/flashinfer && find . -path "*/cached_ops/*/*.so" | sed "s|.*/cached_ops/||" > /tmp/fi-so.txt \
        && tar czf - -C "$(dirname "$(find . -type d -name cached_ops | head -1)")/cached_ops" -T /tmp/fi-so.txt) \
        | split -b 15m - "$out/fi-aot.tgz.part-" && ls -la "$out"/fi-aot.tgz.part-* && cat /tmp/fi-so.txt ;;
    *) python3 -m b12x_inductor.bench "$part" --quick --out "$out/$part.json" 2>&1 | tee "$out/bench-$part.log" ;;
  esac
done
if [ -n "${OUT:-}" ] && [ "$(find "$out" -type f | wc -l)" -gt 8 ]; then
  (cd "$out" && find . -type f ! -name "fi-aot.tgz.part-*" ! -name results.tgz | sed "s|^\./||" > /tmp/pack.txt \
    && tar czf results.tgz -T /tmp/pack.txt && xargs rm -f < /tmp/pack.txt && echo "packed $(wc -l < /tmp/pack.txt) files into results.tgz")
fi
