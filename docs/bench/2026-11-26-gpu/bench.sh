#!/bin/bash
# After run.sh has set up /tmp/site: the load-test wheel, then `mhaserve bench` runs on the device.
set -u
S=/tmp/g; OUT=${OUT:-/tmp/out}; mkdir -p $OUT
cd "$(dirname "$0")/.."
if [ ! -e /tmp/site/.ok5 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/c5/*.whl || exit 6
  touch /tmp/site/.ok5
fi
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
M=$S/b/models
B="python3 -m mhaserve.cli bench --no-torch --rss-requests 0 --batching length --protocols grpc,http --retries 0"
for what in "$@"; do
  case $what in
    smoke) timeout 150 $B --quick --device ${DEV:-cuda} --workloads short --concurrency 1,8 --paired 0 --output /tmp/bq > /tmp/bq.log 2>&1; echo "smoke rc $?"; tail -n 25 /tmp/bq.log ;;
    cuda) timeout 290 $B --repository $M --device cuda --graph optimized --workloads short,mixed --concurrency 1,32,128 --batch-sizes 1,8,32,128 --duration 5 --min-time 2 --paired 1 --output $OUT/bench-cuda > $OUT/bench-cuda.log 2>&1; echo "cuda rc $?"; rm -f $OUT/bench-cuda/*.png ;;
    cpu) timeout 240 $B --repository $M --device cpu --graph optimized --workloads short --concurrency 1,32 --duration 5 --paired 1 --output $OUT/bench-cpu16 > $OUT/bench-cpu16.log 2>&1; echo "cpu rc $?"; rm -f $OUT/bench-cpu16/*.png ;;
  esac
done
for f in $OUT/bench-*/report.md; do [ -e "$f" ] && { echo "== $f"; grep -E "^\| (short|mixed|paired|server|ONNX|ceiling)|ceiling|/ ceiling" "$f" | head -40; }; done
