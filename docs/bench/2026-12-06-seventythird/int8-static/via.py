from pathlib import Path

import grpc
import numpy as np

from mhaserve.export import int8_gate as g
from mhaserve.proto.encoder.v1 import encoder_pb2 as pb
from mhaserve.proto.encoder.v1 import encoder_pb2_grpc as rpc
from mhaserve.runtime.engine import OnnxEngine
from mhaserve.runtime.tokenizer import load_for_serving

d = Path("models/all-minilm-l6-v2/1")
batch = ["why does ice float on water", "why is the sky blue", "how are volcanoes formed", "Thanks, that works."]
stub = rpc.EncoderServiceStub(grpc.insecure_channel("127.0.0.1:17051"))
print([f.name for f in pb.EncodeRequest.DESCRIPTOR.fields])
r = stub.Encode(pb.EncodeRequest(texts=batch))
got = np.array([list(e.values) for e in r.embeddings], dtype=np.float32)
tok = load_for_serving(d / "tokenizer.json", 256)
enc = [e.ids for e in tok.encode_batch(batch)]
ref = OnnxEngine(d / "model.optimized.onnx", max_seq_len=256, vocab_size=30522, device="cpu").run(*g._pad(enc, 0))
c = OnnxEngine(d / "model.int8.onnx", max_seq_len=256, vocab_size=30522, device="cpu")
print("server", np.round(g._cosines(ref, got), 5))
for perm in ([0, 1, 2, 3], [3], [2, 3], [1, 2, 3], [0, 3]):
    out = c.run(*g._pad([enc[i] for i in perm], 0))
    print(perm, np.round(g._cosines(ref[perm], out), 5))
c1 = OnnxEngine(d / "model.int8.onnx", max_seq_len=256, vocab_size=30522, device="cpu", intra_op_threads=1)
print("1 thread", np.round(g._cosines(ref, c1.run(*g._pad(enc, 0))), 5))
