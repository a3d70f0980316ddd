"""Prototype: QAttention inputs quantised with calibrated constant scale/zero point instead of per-batch dynamic."""

import os
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper

from mhaserve.export import int8_gate as g
from mhaserve.runtime.tokenizer import load_for_serving

d = Path("models/all-minilm-l6-v2/1")
margin = float(sys.argv[2]) if len(sys.argv) > 2 else 1.0
SRC = sys.argv[3] if len(sys.argv) > 3 else str(d / "model.int8.onnx")
m = onnx.load(SRC)
# which DynamicQuantizeLinear nodes get a calibrated constant range: those feeding QAttention (the default), or
# with "all" every one whose input is not row-scaled (not the output of the row scale's Mul)
prod = {o: n for n in m.graph.node for o in n.output}
if len(sys.argv) > 4 and sys.argv[4] == "all":
    dql = [n for n in m.graph.node if n.op_type == "DynamicQuantizeLinear" and prod[n.input[0]].op_type != "Mul"]
else:
    dql = [
        n
        for n in m.graph.node
        if n.op_type == "DynamicQuantizeLinear"
        and any(u.op_type == "QAttention" and n.output[0] in u.input for u in m.graph.node)
    ]
names = [n.input[0] for n in dql]
print(len(dql), "DQL feeding QAttention")
# calibration: add outputs
mc = onnx.load(SRC)
for nm in names:
    mc.graph.output.append(helper.make_tensor_value_info(nm, onnx.TensorProto.FLOAT, None))
s = ort.InferenceSession(mc.SerializeToString(), providers=["CPUExecutionProvider"])
tok = load_for_serving(d / "tokenizer.json", 256)
items = g.retrieval_set()
texts = g.fidelity_texts() + [q for q, _ in items] + [p for _, ps in items for p in ps]
if os.environ.get("CAL"):  # calibrate on other texts than the gate's: a file of one text a line, its first CAL_N
    texts = Path(os.environ["CAL"]).read_text().splitlines()[: int(os.environ.get("CAL_N", "500"))]
lo = {nm: 0.0 for nm in names}
hi = {nm: 0.0 for nm in names}
inames = [i.name for i in s.get_inputs()]
for e in tok.encode_batch(texts):
    ids = np.array([e.ids], dtype=np.int64)
    mask = np.ones_like(ids)
    feed = {inames[0]: ids, inames[1]: mask}
    outs = s.run(names, feed)
    for nm, o in zip(names, outs, strict=True):
        lo[nm] = min(lo[nm], float(o.min()))
        hi[nm] = max(hi[nm], float(o.max()))
for nm in names:
    print(nm, round(lo[nm], 2), round(hi[nm], 2))
# replace
new_nodes = []
for n in m.graph.node:
    if n in dql:
        nm = n.input[0]
        a, b = lo[nm] * margin, hi[nm] * margin
        scale = (b - a) / 255.0
        zp = int(round(-a / scale))
        zp = max(0, min(255, zp))
        sc = numpy_helper.from_array(np.array(scale, dtype=np.float32), n.output[1])
        z = numpy_helper.from_array(np.array(zp, dtype=np.uint8), n.output[2])
        m.graph.initializer.extend([sc, z])
        new_nodes.append(
            helper.make_node("QuantizeLinear", [nm, n.output[1], n.output[2]], [n.output[0]], name=n.name + "_static")
        )
    else:
        new_nodes.append(n)
del m.graph.node[:]
m.graph.node.extend(new_nodes)
onnx.save(m, sys.argv[1])
print("saved", sys.argv[1])
