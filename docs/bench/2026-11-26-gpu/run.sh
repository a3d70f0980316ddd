#!/bin/bash
# Device run of `make gpu-check`: unpack the carried bundle (onnxruntime-gpu for cp312, the serving
# dependencies, the MiniLM fused graph, a tiny model), install into /tmp/site, then run the checks.
set -u
S=/tmp/g
OUT=${OUT:-/tmp/out}
mkdir -p $S/b /tmp/site $OUT
if [ ! -e /tmp/site/.ok ]; then
  cat $S/part.* > $S/bundle.tar && python3 - <<'PY' || exit 3
import lzma, shutil, tarfile
S = "/tmp/g"
tarfile.open(f"{S}/bundle.tar").extractall(f"{S}/b", filter="data")
tarfile.open(f"{S}/b/ort-rest.tar.xz").extractall("/tmp/site", filter="data")
with lzma.open(f"{S}/b/cuda90.so.xz") as src, open("/tmp/site/onnxruntime/capi/libonnxruntime_providers_cuda.so", "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 24)
with lzma.open(f"{S}/b/minilm.opt.xz") as src, open(f"{S}/b/models/all-minilm-l6-v2/1/model.optimized.onnx", "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 24)
PY
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $S/b/whl/*.whl || exit 4
  nv=$(python3 -c "import nvidia, os; print(list(nvidia.__path__)[0])")
  ln -sfn "$nv" /tmp/site/nvidia
  touch /tmp/site/.ok
fi
if [ -e $S/extra.tar ] && [ ! -e $S/b/.ok16 ]; then
  python3 - <<'PY' || exit 5
import lzma, shutil, tarfile
S = "/tmp/g"
tarfile.open(f"{S}/extra.tar").extractall(f"{S}/b", filter="data")
with lzma.open(f"{S}/b/minilm.fp16.xz") as src, open(f"{S}/b/m16/all-minilm-l6-v2/1/model.fp16.onnx", "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 24)
PY
  touch $S/b/.ok16
fi
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
{
  date -u; nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv
  python3 -c "import sys, onnxruntime as o, numpy, grpc, google.protobuf as pb, tokenizers; print(sys.version.split()[0], 'onnxruntime', o.__version__, o.get_build_info() if hasattr(o,'get_build_info') else '', o.get_available_providers(), 'numpy', numpy.__version__, 'grpcio', grpc.__version__, 'protobuf', pb.__version__, 'tokenizers', tokenizers.__version__)"
  lscpu | grep -E "Model name|^CPU\(s\)"
} 2>&1 | tee $OUT/env.txt
sha256sum $S/b/models/all-minilm-l6-v2/1/model.optimized.onnx
for what in "$@"; do
  case $what in
    minilm) timeout 240 python3 -m mhaserve.testing.gpu_check --repository $S/b/models --model all-minilm-l6-v2 2>&1 | tee $OUT/gpu-check-minilm.txt ;;
    minilm16) timeout 240 python3 -m mhaserve.testing.gpu_check --repository $S/b/m16 --model all-minilm-l6-v2 --graph fp16 2>&1 | tee $OUT/gpu-check-minilm-fp16.txt ;;
    tiny) for g in fp32 optimized fp16; do timeout 120 python3 -m mhaserve.testing.gpu_check --repository $S/b/tiny --model tiny --graph $g --seconds 2 2>&1; done | tee $OUT/gpu-check-tiny.txt ;;
    pytest) timeout 300 python3 -m pytest -p no:cacheprovider -o addopts="" -rs -m gpu tests/service/test_gpu.py 2>&1 | tee $OUT/pytest-gpu.txt ;;
  esac
done
