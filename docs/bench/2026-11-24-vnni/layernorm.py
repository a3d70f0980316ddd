"""ONNX Runtime's SkipLayerNormalization against the same arithmetic in plain operators, one thread, CPU time.

The plain form is the one export/quantize.py writes into the int8 graph (Reciprocal and Mul, not Div, so that
ONNX Runtime's LayerNormFusion does not put the slow kernel back). BiasGelu against its plain form is measured
too: there the fused kernel is the faster one. Run: .venv/bin/python docs/bench/2026-11-24-vnni/layernorm.py
"""

import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

MS = "com.microsoft"


def session(nodes, width, initializers, fused):
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["b", "s", width]) for n in ("x", "skip")]
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    used = {i for n in nodes for i in n.input}
    graph = helper.make_graph(nodes, "g", [i for i in inputs if i.name in used], [out], initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(MS, 1)])
    model.ir_version = 9
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    if not fused:  # nothing to fuse in the plain graphs' patterns; this only keeps the comparison plain
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def cpu_us(sess, feed, n=1000):
    for _ in range(100):
        sess.run(None, feed)
    t = time.thread_time()
    for _ in range(n):
        y = sess.run(None, feed)[0]
    return (time.thread_time() - t) / n * 1e6, y


def node(op, inputs, out, **attrs):
    return helper.make_node(
        op, inputs, [out], domain=MS if op in ("SkipLayerNormalization", "BiasGelu") else "", **attrs
    )


rng = np.random.default_rng(0)
init = [
    numpy_helper.from_array(rng.random(384, dtype=np.float32), "gamma"),
    numpy_helper.from_array(rng.random(384, dtype=np.float32), "beta"),
    numpy_helper.from_array(np.array([-1], np.int64), "axes"),
    numpy_helper.from_array(np.array(1e-12, np.float32), "eps"),
]
fused_ln = [node("SkipLayerNormalization", ["x", "skip", "gamma", "beta"], "y", epsilon=1e-12)]
plain_ln = [
    node("Add", ["x", "skip"], "s"),
    node("ReduceMean", ["s", "axes"], "m"),
    node("Sub", ["s", "m"], "d"),
    node("Mul", ["d", "d"], "d2"),
    node("ReduceMean", ["d2", "axes"], "v"),
    node("Add", ["v", "eps"], "ve"),
    node("Sqrt", ["ve"], "sd"),
    node("Reciprocal", ["sd"], "r"),
    node("Mul", ["d", "r"], "n"),
    node("Mul", ["n", "gamma"], "ng"),
    node("Add", ["ng", "beta"], "y"),
]
for shape in ((1, 20, 384), (1, 45, 384), (4, 30, 384), (16, 45, 384)):
    feed = {"x": rng.standard_normal(shape, dtype=np.float32), "skip": rng.standard_normal(shape, dtype=np.float32)}
    a, ya = cpu_us(session(fused_ln, 384, init, True), feed)
    b, yb = cpu_us(session(plain_ln, 384, init, False), feed)
    diff = np.abs(ya - yb).max()
    print(f"{shape}: SkipLayerNormalization {a:.1f} us, plain {b:.1f} us ({a / b:.2f}x), max diff {diff:.1e}")

init = [
    numpy_helper.from_array(rng.standard_normal(1536, dtype=np.float32), "bias"),
    numpy_helper.from_array(np.array(0.7071067811865476, np.float32), "c"),
    numpy_helper.from_array(np.array(1.0, np.float32), "one"),
    numpy_helper.from_array(np.array(0.5, np.float32), "half"),
]
fused_gelu = [node("BiasGelu", ["x", "bias"], "y")]
plain_gelu = [
    node("Add", ["x", "bias"], "s"),
    node("Mul", ["s", "c"], "sc"),
    node("Erf", ["sc"], "e"),
    node("Add", ["e", "one"], "e1"),
    node("Mul", ["s", "half"], "sh"),
    node("Mul", ["sh", "e1"], "y"),
]
for shape in ((1, 20, 1536), (16, 45, 1536)):
    feed = {"x": rng.standard_normal(shape, dtype=np.float32)}
    a, _ = cpu_us(session(fused_gelu, 1536, init, False), feed, 500)
    b, _ = cpu_us(session(plain_gelu, 1536, init, False), feed, 500)
    print(f"{shape}: BiasGelu {a:.1f} us, plain {b:.1f} us ({a / b:.2f}x)")
