#!/bin/bash
# The bundle for the fourth GPU run, as made (2026-12-04, in /tmp/gpuw, on the 2-core machine; about 5 min,
# xz one at a time). Follows ../2026-11-26-gpu/bundle.sh and the third run (../2026-11-27-gpu/), without
# the tiny model and the fp16 extra: pytest exports the tiny model on the device (tests/conftest.py).
# The device reaches no package index and a call carries at most 64 MiB, so everything is compressed and
# split into parts of 45,000,000 bytes under .gpu/ (ignored by git through .git/info/exclude: `/.gpu/`).
set -eu
R=/work/main; G=/tmp/gpuw; PIP="$R/.venv/bin/pip"
rm -rf $G && mkdir -p $G && cd $G
# 1. onnxruntime-gpu, the version the .venv runs (pyproject's floor is >=1.20), as the device's cp312 wheel.
$PIP download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 onnxruntime-gpu==1.31.1 -d ort
unzip -q ort/onnxruntime_gpu-1.31.1-cp312-cp312-manylinux_2_28_x86_64.whl -d x
# the CUDA provider (284 MB) with every cubin but sm_90's zeroed (the H200 loads only those): 51.4 MB xz'd
python3 $R/docs/bench/2026-11-26-gpu/blank.py x/onnxruntime/capi/libonnxruntime_providers_cuda.so cuda90.so
# sha256 of the wheel's provider 8387867e8574..., of the blanked one b9e67d0f2f58...
sha256sum x/onnxruntime/capi/libonnxruntime_providers_cuda.so cuda90.so > so.sha
xz -9e -T1 -c cuda90.so > cuda90.so.xz
# the rest of the wheel less the CUDA and TensorRT providers; members are ./onnxruntime/..., so it
# extracts into a site-packages folder (run.sh: /tmp/site/onnxruntime/...)
(cd x && tar cf - --exclude=./onnxruntime/capi/libonnxruntime_providers_cuda.so \
  --exclude=./onnxruntime/capi/libonnxruntime_providers_tensorrt.so . | xz -9e -T1 > ../ort-rest.tar.xz)
# 2. MiniLM's fused graph, the one docs/benchmarks.md measures (sha256 9bfa15bae335...db88 uncompressed)
xz -9e -T1 -c $R/models/all-minilm-l6-v2/1/model.optimized.onnx > minilm.opt.xz
(cd $R/models/all-minilm-l6-v2/1 && sha256sum model.optimized.onnx manifest.json tokenizer.json) > minilm.sha
# 3. wheels for Python 3.12 at the .venv's versions (pip freeze), --no-deps: the runtime dependencies'
# closure (opentelemetry-api for FastAPI, whose absence broke the third run's first call; click and h11
# for uvicorn; flatbuffers and packaging for onnxruntime), pytest and pytest-timeout (pyproject's
# `timeout`) with their dependencies, hypothesis, and what the tiny model's export imports besides torch
# (onnx, onnxscript, onnx-ir, ml-dtypes, safetensors, tqdm). Left out: torch and its sympy, mpmath,
# filelock, networkx (the device's torch brings them), nvidia-* (the device's), and huggingface-hub,
# which tokenizers declares but never imports to read tokenizer.json.
P="--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64
   --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64
   --platform manylinux1_x86_64 --platform linux_x86_64 --platform any"
mkdir whl && $PIP download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --abi cp312 --abi abi3 --abi none $P -d whl \
  annotated-doc==0.0.7 annotated-types==0.8.0 anyio==4.16.0 click==8.5.1 fastapi==0.165.0 \
  flatbuffers==25.12.19 grpcio==1.85.3 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 h11==0.16.0 \
  hpack==4.2.0 httptools==0.9.0 idna==3.20 numpy==2.4.6 opentelemetry-api==1.45.2 orjson==3.13.0 \
  packaging==26.4 prometheus-client==0.26.0 protobuf==7.36.2 pydantic==2.14.4 pydantic-core==2.50.5 \
  sniffio==1.3.1 starlette==1.10.0 tokenizers==0.23.3 typing-extensions==4.16.0 typing-inspection==0.4.5 \
  uvicorn==0.55.0 \
  pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 pygments==2.21.0 pytest-timeout==2.4.0 \
  hypothesis==6.170.27 sortedcontainers==2.4.0 \
  onnx==1.23.2 onnx-ir==1.1.0 onnxscript==0.7.2 ml-dtypes==0.7.0 safetensors==0.8.0 tqdm==4.70.1
# our two wheels (mhaserve, mhaserve-loadtest), from the commit (git archive), not the working tree
mkdir src && git -C $R archive HEAD | tar -x -C src   # HEAD: a9652a2d8bbb51ca7de830d1fcebc8204c03c206
(cd src && $R/.venv/bin/python -m pip wheel -q --no-deps --no-build-isolation -w $G/ours . ./loadtest)
cp ours/*.whl whl/
# 4. pack and split: c1 (part.00 and bundle.sha), c2, c3, c4, one a call
B=$G/bundle; mkdir -p $B/models/all-minilm-l6-v2/1
cp $R/models/all-minilm-l6-v2/1/{manifest.json,tokenizer.json} $B/models/all-minilm-l6-v2/1/
cp cuda90.so.xz ort-rest.tar.xz minilm.opt.xz $B/ && cp -r whl $B/whl
# The first split (55 MB parts) was refused: a call carries the working tree (19.7 MB tracked) with its part,
# 64 MiB in all. So the wheels the device's image already has at compatible versions (its env.txt: numpy
# 2.5.2, tokenizers 0.23.2, onnx 1.23.1, onnxscript 0.7.2, with torch 2.11) were taken out of the bundle
# (163.5 MB, sha256 c814b3318597...) and it was split into 45 MB parts: still four calls.
rm -f $B/whl/numpy-* $B/whl/onnx-1* $B/whl/onnx_ir-* $B/whl/onnxscript-* $B/whl/ml_dtypes-* $B/whl/tokenizers-*
(cd $B && tar cf $G/bundle.tar cuda90.so.xz ort-rest.tar.xz whl models minilm.opt.xz)
sha256sum bundle.tar > bundle.sha
W=$R/.gpu; rm -rf $W/c*; mkdir -p $W/tmp
(cd $W/tmp && split -b 45000000 -d -a 2 $G/bundle.tar part.)
for p in $W/tmp/part.*; do n=$((10#${p##*.} + 1)); mkdir -p $W/c$n && mv $p $W/c$n/; done
rmdir $W/tmp && cp bundle.sha $W/c1/
git -C $R check-ignore -q .gpu/c1/part.00 && ls -la $W/*/
# Checked before the run: `pip install --dry-run --no-index --find-links whl --python-version 3.12 --target`
# of mhaserve, pytest, pytest-timeout, hypothesis, onnxscript, safetensors resolves from whl/ with only
# onnxruntime-gpu (the bundle's own) and stand-ins for huggingface-hub and sympy; and run.sh's recv and
# setup, rehearsed on Python 3.12.1 (GPU_STAGE=/tmp/g-test GPU_SITE=/tmp/site-test PY=python3.12), join
# and check the parts, lay out /tmp/site-test/onnxruntime with the blanked provider, import the server,
# gpu_check, the HTTP API, bench and the export, and gpu_check stops at "could not load CUDA"
# (libcublasLt.so.13); pytest collects test_gpu.py and stops at the export's `import torch`.
