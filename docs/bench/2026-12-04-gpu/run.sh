#!/bin/bash
# The fourth GPU run, on the lent device: `make gpu-check`'s two steps, then `mhaserve bench` on CUDA.
# The device reaches no package index: the bundle (onnxruntime-gpu 1.31.1 for cp312 with the non-sm_90
# cubins of its CUDA provider blanked by ../2026-11-26-gpu/blank.py, the serving dependencies' wheels, the
# test tooling's (pytest, hypothesis; onnx and onnxscript are the image's) and ours built from a9652a2, MiniLM's
# fused graph) travels in four parts under .gpu/c1..c4, one a call; made by bundle.sh beside this file.
# Usage: run.sh recv | setup | check | pytest | bench ...
#   recv: on each call, copies the parts that call carried to /tmp/g (a warm machine keeps /tmp between calls);
#   setup: once all have come, joins and checks them, unpacks into /tmp/site.
# GPU_STAGE, GPU_SITE and PY (default /tmp/g, /tmp/site, python3) are there only to rehearse setup off the device.
set -u
S=${GPU_STAGE:-/tmp/g}; SITE=${GPU_SITE:-/tmp/site}; PY=${PY:-python3}; OUT=${OUT:-/tmp/out}
mkdir -p $S/b $SITE $OUT
cd "$(dirname "$0")/../../.."
export PYTHONUNBUFFERED=1 GPU_STAGE=$S GPU_SITE=$SITE
for what in "$@"; do
  case $what in
    recv)
      # only what this call carried: a part already copied (same bytes) is left alone
      for f in .gpu/c*/*; do
        [ -f "$f" ] || continue
        cmp -s "$f" "$S/${f##*/}" || cp "$f" $S/ || exit 2
      done
      ls -la $S ;;
    setup)
      if [ ! -e $SITE/.ok ]; then
        (cd $S && cat part.* > bundle.tar && sha256sum -c bundle.sha) || exit 3
        $PY - <<'PY' || exit 4
import lzma, os, shutil, tarfile
S, SITE = os.environ["GPU_STAGE"], os.environ["GPU_SITE"]
tarfile.open(f"{S}/bundle.tar").extractall(f"{S}/b", filter="data")
tarfile.open(f"{S}/b/ort-rest.tar.xz").extractall(SITE, filter="data")
for src, dst in [("cuda90.so.xz", f"{SITE}/onnxruntime/capi/libonnxruntime_providers_cuda.so"),
                 ("minilm.opt.xz", f"{S}/b/models/all-minilm-l6-v2/1/model.optimized.onnx")]:
    with lzma.open(f"{S}/b/{src}") as i, open(dst, "wb") as o:
        shutil.copyfileobj(i, o, 1 << 24)
PY
        $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $SITE $S/b/whl/*.whl || exit 5
        # onnxruntime's preload_dlls() finds CUDA and cuDNN beside it, as pip's nvidia-* packages lay them out
        nv=$($PY -c 'import nvidia; print(list(nvidia.__path__)[0])') && ln -sfn "$nv" $SITE/nvidia || echo "setup: no nvidia package in this python"
        touch $SITE/.ok
      fi
      export PYTHONPATH=$SITE
      { date -u; nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv
        $PY -c "import sys, onnxruntime as o, numpy, grpc, google.protobuf as pb, tokenizers, torch; print(sys.version.split()[0], 'onnxruntime', o.__version__, o.get_available_providers(), 'numpy', numpy.__version__, 'grpcio', grpc.__version__, 'protobuf', pb.__version__, 'tokenizers', tokenizers.__version__, 'torch', torch.__version__)"
        lscpu | grep -E "Model name|^CPU\(s\)"; sha256sum $S/b/models/all-minilm-l6-v2/1/model.optimized.onnx; } 2>&1 | tee $OUT/env.txt ;;
    check) timeout 200 $PY -m mhaserve.testing.gpu_check --repository $S/b/models --model all-minilm-l6-v2 2>&1 | tee $OUT/gpu-check-minilm.txt ;;
    pytest) timeout 200 $PY -m pytest -p no:cacheprovider -o addopts="" -rs -m gpu tests/service/test_gpu.py 2>&1 | tee $OUT/pytest-gpu.txt ;;
    bench)
      timeout ${BENCH_S:-240} $PY -m mhaserve.cli bench --repository $S/b/models --device cuda --graph optimized \
        --workloads short --concurrency 1,32 --batch-sizes 1,8,32,128 --duration 5 --min-time 2 --paired 3 \
        --protocols grpc,http --batching length --no-torch --rss-requests 0 --retries 0 --quiet-wait 0 \
        --output $OUT/bench-cuda > $OUT/bench-cuda.log 2>&1; echo "bench rc $?"; rm -f $OUT/bench-cuda/*.png
      grep -E "paired|ceiling|one client|clients" $OUT/bench-cuda.log | tail -20 ;;
  esac
done
