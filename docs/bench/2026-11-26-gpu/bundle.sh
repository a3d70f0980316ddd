#!/bin/bash
# The bundle, as built for the first GPU run. Made before it, by hand, in /tmp/gpuw:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 ... onnxruntime-gpu==1.31.1, unzipped to x/;
#   python blank.py x/onnxruntime/capi/libonnxruntime_providers_cuda.so cuda90.so; xz -9e -c cuda90.so > cuda90.so.xz;
#   the rest of the wheel (less the CUDA and TensorRT providers): tar cf - . | xz -9e > ort-rest.tar.xz;
#   xz -9e of models/all-minilm-l6-v2/1/model.optimized.onnx (minilm.opt.xz) and of an fp16 export (minilm.fp16.xz);
#   a tiny random model exported with --optimize --fp16 (tiny/); the wheels of the serving dependencies in .gpu/c1/whl.
# Then this packs them and splits them into the parts each device call carries (.gpu/ is ignored by git).
set -eu
G=/tmp/gpuw; B=$G/bundle; rm -rf $B; mkdir -p $B/models/all-minilm-l6-v2/1 $B/m16/all-minilm-l6-v2/1
cp /work/main/models/all-minilm-l6-v2/1/{manifest.json,tokenizer.json} $B/models/all-minilm-l6-v2/1/
cp $G/m16/all-minilm-l6-v2/1/{manifest.json,tokenizer.json} $B/m16/all-minilm-l6-v2/1/
cp $G/cuda90.so.xz $G/minilm.opt.xz $G/ort-rest.tar.xz $G/minilm.fp16.xz $B/
cp -r /work/main/.gpu/c1/whl $B/whl
cp -r $G/tiny $B/tiny
(cd $B && tar cf $G/bundle.tar cuda90.so.xz ort-rest.tar.xz whl models tiny minilm.opt.xz && tar cf $G/extra.tar m16 minilm.fp16.xz)
W=/work/main/.gpu; rm -rf $W/c1 $W/c2 $W/c3 $W/c4; mkdir -p $W/c1 $W/c2 $W/c3 $W/c4
(cd $W && split -b 55000000 -d -a 2 $G/bundle.tar part. && mv part.00 c1/ && mv part.01 c2/ && mv part.02 c3/ && cp $G/extra.tar c4/)
ls -la $W/*/ ; ls $W
