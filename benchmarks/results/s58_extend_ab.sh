# one A/B pass: $1 pass number, $2 D64|D128; configs Q:K:E = B12X_EXTEND_Q_BUFS : _KEYS_AHEAD : _END_ALIGN
# Kept as it ran. The three switches (B12X_EXTEND_Q_BUFS, _KEYS_AHEAD, _END_ALIGN) existed only in the code of
# that call: Q:K:E = 1:0:0 was the kernel before session 58, 2:1:1 the one that landed (which has no switches).
G=$(nvidia-smi --query-gpu=name --format=csv,noheader | tr -d ' ' | cut -c1-12)
case $2 in
  D64) D=64; ROWS=16x1024,8x2048,4x4096; V="--variants cute:0:0:0:16:192"; CFGS=${CFGS:-"1:0:0 2:1:1"} ;;
  D128) D=128; ROWS=16x1024,8x2048; V=""; CFGS=${CFGS:-"1:0:0 1:1:1"} ;;
esac
for c in $CFGS; do
  IFS=: read q k e <<< "$c"
  t=s58_${2}_q${q}k${k}e${e}_p$1
  B12X_EXTEND_Q_BUFS=$q B12X_EXTEND_KEYS_AHEAD=$k B12X_EXTEND_END_ALIGN=$e timeout 200 python3 -m b12x_inductor.bench --rows extend --head-dim $D --extend-rows $ROWS --peers ${PEERS:-sdpa} --packed $V --out /tmp/bj --tag ${t}_$G > $OUT/bench_${t}_$G.log 2>&1
  echo "$t rc $?"; grep "^\[" $OUT/bench_${t}_$G.log | cut -c1-220
done
