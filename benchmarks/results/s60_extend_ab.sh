# Session 60: GPU tests and an A/B of the open-item change (s60_open_item.patch) against the extend kernel as on
# main, each version in its own process, with SDPA in the same processes. Run from the project root on the GPU
# machine with the CuTe DSL installed (../shared/device/README.md); the patch applies to main at dacebb5.
set -e
cp kernels/cute/extend.py /tmp/extend_main.py
patch -p1 < benchmarks/results/s60_open_item.patch
cp kernels/cute/extend.py /tmp/extend_open.py
export CUTE_DSL_DISABLE_FILE_CACHING=1
python3 -m pytest -q -m gpu tests/test_cute_kernels.py -k extend -n 14 -rA -p no:cacheprovider | tail -3
B="python3 -m b12x_inductor.bench kernels --rows extend --peers sdpa --packed --out /tmp"
for pass in 1 2; do
  for v in main open; do
    cp /tmp/extend_$v.py kernels/cute/extend.py
    $B --extend-rows 16x1024,8x2048,4x4096 | grep "^\[extend"
    $B --extend-rows 16x1024,8x2048,4x4096 --head-dim 64 | grep "^\[extend"
  done
done
