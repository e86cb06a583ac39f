# Sessions 60-61: the extend GPU tests, then an A/B of two versions of kernels/cute/extend.py, each in its own
# process, with SDPA in the same processes, at D 128, 64 and 256. Run from the project root on the GPU machine with
# the CuTe DSL installed (../shared/device/README.md): bash benchmarks/results/s60_extend_ab.sh OLD_EXTEND_PY,
# OLD_EXTEND_PY the other version, the working tree's being the new one. Session 61 ran it (without D 256) on
# `git show dacebb5:kernels/cute/extend.py`; for s61_q_issue.patch: `cp kernels/cute/extend.py old_extend.py &&
# patch -p1 < benchmarks/results/s61_q_issue.patch`, then this script on old_extend.py.
# Superseded in session 63 by benchmarks/extend_ab.py (all versions in one process); s61_q_issue.patch is in commit
# 0910c01.
set -e
cp "$1" /tmp/extend_old.py
cp kernels/cute/extend.py /tmp/extend_new.py
export CUTE_DSL_DISABLE_FILE_CACHING=1
python3 -m pytest -q -m gpu tests/test_cute_kernels.py -k extend -n 14 -rA -p no:cacheprovider | tail -3
B="python3 -m b12x_inductor.bench kernels --rows extend --peers sdpa --packed --out /tmp"
for pass in 1 2; do
  for v in old new; do
    cp /tmp/extend_$v.py kernels/cute/extend.py
    $B --extend-rows 16x1024,8x2048,4x4096 | grep "^\[extend"
    $B --extend-rows 16x1024,8x2048,4x4096 --head-dim 64 | grep "^\[extend"
    $B --extend-rows 16x1024,4x4096 --head-dim 256 | grep "^\[extend"
  done
done
cp /tmp/extend_new.py kernels/cute/extend.py
