"""What static activation scales could save on this CPU: one int8 matrix product, three ways, one thread, CPU time.

fp32 MatMul; DynamicQuantizeMatMul (what the int8 graph runs: the activation's range found and quantised at
run time); MatMulIntegerToFloat on an activation already in uint8 (the most a static scale could save) and
after a QuantizeLinear with a fixed scale (what a static graph runs). 7-bit per-channel weights, as the plan's.
Run: .venv/bin/python docs/bench/2026-11-24-vnni/static_vs_dynamic.py
"""

import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

MS = "com.microsoft"


def session(nodes, inputs, initializers):
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    used = {i for n in nodes for i in n.input}
    graph = helper.make_graph(nodes, "g", inputs, [out], [t for t in initializers if t.name in used])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)])
    model.ir_version = 9
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def cpu_us(sess, feed, n=400):
    for _ in range(50):
        sess.run(None, feed)
    t = time.thread_time()
    for _ in range(n):
        sess.run(None, feed)
    return (time.thread_time() - t) / n * 1e6


rng = np.random.default_rng(0)
for k, n in ((384, 1536), (1536, 384), (384, 384)):
    w = rng.standard_normal((k, n), dtype=np.float32) * 0.05
    w_scale = (np.abs(w).max(0) / 63).astype(np.float32)
    init = [
        numpy_helper.from_array(w, "w"),
        numpy_helper.from_array(np.clip(np.round(w / w_scale), -64, 63).astype(np.int8), "wq"),
        numpy_helper.from_array(w_scale, "ws"),
        numpy_helper.from_array(np.array(0.01, np.float32), "as"),
        numpy_helper.from_array(np.array(128, np.uint8), "az"),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", k])
    xq = helper.make_tensor_value_info("xq", TensorProto.UINT8, ["m", k])
    to_float = helper.make_node("MatMulIntegerToFloat", ["q", "wq", "as", "ws", "az"], ["y"], domain=MS)
    fp32 = session([helper.make_node("MatMul", ["x", "w"], ["y"])], [x], init)
    dynamic = session([helper.make_node("DynamicQuantizeMatMul", ["x", "wq", "ws"], ["y"], domain=MS)], [x], init)
    ready = session([helper.make_node("Identity", ["xq"], ["q"]), to_float], [xq], init)
    static = session([helper.make_node("QuantizeLinear", ["x", "as", "az"], ["q"]), to_float], [x], init)
    for m in (20, 80, 640):
        xf = rng.standard_normal((m, k), dtype=np.float32)
        a = cpu_us(fp32, {"x": xf})
        b = cpu_us(dynamic, {"x": xf})
        c = cpu_us(ready, {"xq": rng.integers(0, 255, (m, k), dtype=np.uint8)})
        d = cpu_us(static, {"x": xf})
        print(
            f"{m}x{k} @ {k}x{n}: fp32 {a:.0f} us; dynamic {a / b:.2f}x; uint8 input {a / c:.2f}x; "
            f"QuantizeLinear + product {a / d:.2f}x"
        )
