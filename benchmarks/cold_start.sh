#!/usr/bin/env bash
# Cold start of the serving engine (issue 20): `python -m b12x_inductor.serve --demo` with a compile cache,
# whole-model and regional compile, each run twice (the first cold, the second warm on the same machine).
#
#   bash benchmarks/cold_start.sh OUTDIR [FROM]
#
# OUTDIR gets, per MODE (whole, regional): cc-MODE/ (the compile cache the runs used and saved), MODE-cold.json
# (or MODE-artifacts.json when FROM is given), MODE-warm.json (the serve CLI's --json report, with the warm-up
# per bucket), and summary.txt. FROM: a directory with cc-whole/ and cc-regional/ saved by an earlier run (on
# another machine: its first runs then start from a copy of those). SERVE_ARGS: more arguments for every run
# (e.g. SERVE_ARGS="--size small" on CPU).
set -euo pipefail
out=$(mkdir -p "$1" && cd "$1" && pwd)
from=${2:+$(cd "$2" && pwd)}
cd "$(dirname "$0")/.."
summary="$out/summary.txt"
run() {  # NAME ARGS...: one serve run, its report to NAME.json, a line to summary.txt
  local name=$1; shift
  local t0; t0=$(date +%s.%N)
  python3 -m b12x_inductor.serve --demo --no-progress --json ${SERVE_ARGS:-} "$@" > "$out/$name.json" 2> "$out/$name.log"
  python3 - "$out/$name.json" "$name" "$t0" "$(date +%s.%N)" <<'PY' | tee -a "$summary"
import json, sys
path, name, t0, t1 = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
d = json.load(open(path))
w = d["warmup"]
print(f"{name:18s} warm-up {w['total_s']:6.1f} s (compile {w['compile_s']:.1f}, capture {w['capture_s']:.1f}), "
      f"process {t1 - t0:6.1f} s, {d['throughput_tok_s']:.0f} tok/s, artifacts loaded {w['loaded_artifacts']}")
for b in w["buckets"]:
    print(f"    {b['kind']:6s} {b['rows']:4d}x{b['width']:<4d} compile {b['compile_s']:6.2f} (dynamo {b['dynamo_s']:5.2f}, "
          f"backend {b['backend_s']:6.2f})  capture {b['capture_s']:5.2f}  graphs {b['graphs']}  {b['source']}")
PY
}
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')" | tee "$summary"
for mode in whole regional; do
  flag=(--whole-model-compile); [ "$mode" = regional ] && flag=(--regional-compile)
  cache="$out/cc-$mode"
  first=cold
  if [ -n "$from" ]; then
    rm -rf "$cache" && cp -r "$from/cc-$mode" "$cache"
    first=artifacts
  fi
  run "$mode-$first" "${flag[@]}" --compile-cache "$cache"
  run "$mode-warm" "${flag[@]}" --compile-cache "$cache"
  du -sh "$cache/artifacts.bin" "$cache/inductor" | tee -a "$summary"
done
