"""Ragged batching without padding: several texts packed into one sequence of the fused graph, each attending
only to itself. Exact? And faster than the padded batches it would replace?

The fused graph (models/all-minilm-l6-v2/<v>/model.optimized.onnx) is changed in memory, three ways:
- `position_ids` [1, T]: EmbedLayerNormalization's optional input, so that each text's positions restart
  at 0 inside the pack;
- `packed_mask` [1, T, T]: a block-diagonal mask given to every Attention node instead of the [batch, seq]
  padding mask (ONNX Runtime's CPU Attention takes a 3-D mask), so that no text attends to another;
- `pool` [n, T]: mean pooling per text as one MatMul with the last layer's hidden states.
Then: the packed graph's embeddings against the fused graph's on the same texts padded into a batch
(400 short texts, packs of up to 8 texts and CAP tokens); and the speed of the short texts (2,000, in a
seeded arrival order, tokenisation not counted) packed k at a time, against the same texts sorted by
length in padded batches of 4 and 16 (the bench's ceiling), and in arrival order in padded batches of 4,
alternated in ROUNDS rounds. Both sessions: two intra-op threads, ONNX Runtime's defaults otherwise.
Run from the repository root: python docs/bench/2026-11-26-pack/packed.py ROUNDS CAP
"""

import glob
import random
import statistics
import sys
import time
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

sys.path.insert(0, "docs/bench")
from one_client import SHORT_TEXTS

from mhaserve.runtime.tokenizer import load_for_serving
from mhaserve.service.batching.padding import pad

Feed = tuple[ort.InferenceSession, list[str], dict[str, np.ndarray]]


def packed_graph(path: str) -> onnx.ModelProto:
    m = onnx.load(path)
    g = m.graph
    g.input.append(helper.make_tensor_value_info("position_ids", TensorProto.INT64, [1, "T"]))
    g.input.append(helper.make_tensor_value_info("packed_mask", TensorProto.INT64, [1, "T", "T"]))
    g.input.append(helper.make_tensor_value_info("pool", TensorProto.FLOAT, ["n", "T"]))
    casts = [
        helper.make_node("Cast", ["position_ids"], ["position_ids_int32"], to=TensorProto.INT32),
        helper.make_node("Cast", ["packed_mask"], ["packed_mask_int32"], to=TensorProto.INT32),
    ]
    for node in g.node:
        if node.op_type == "EmbedLayerNormalization":
            node.input.extend(["", "position_ids_int32"])  # input 7, the mask: none; input 8, position ids
        if node.op_type == "Attention":
            node.input[3] = "packed_mask_int32"
    for k, node in enumerate(casts):
        g.node.insert(k, node)
    last = [n for n in g.node if n.op_type == "SkipLayerNormalization"][-1].output[0]
    g.initializer.append(helper.make_tensor("axis0", TensorProto.INT64, [1], [0]))
    g.node.extend([
        helper.make_node("Squeeze", [last, "axis0"], ["hidden"]),
        helper.make_node("MatMul", ["pool", "hidden"], ["packed_embeddings"]),
    ])  # fmt: skip
    g.output.append(helper.make_tensor_value_info("packed_embeddings", TensorProto.FLOAT, ["n", 384]))
    onnx.checker.check_model(m)
    return m


def packs(seqs: list[list[int]], cap: int) -> list[list[list[int]]]:
    out: list[list[list[int]]] = [[]]
    for s in seqs:
        if out[-1] and sum(map(len, out[-1])) + len(s) > cap:
            out.append([])
        out[-1].append(s)
    return out


def packed_feed(session: ort.InferenceSession, pack: list[list[int]]) -> Feed:
    seg = np.concatenate([[i] * len(s) for i, s in enumerate(pack)])
    feed: dict[str, Any] = {
        "input_ids": np.asarray([sum(pack, [])], np.int64),
        "attention_mask": np.ones((1, len(seg)), np.int64),  # the graph's own pooling still reads it
        "position_ids": np.asarray([np.concatenate([np.arange(len(s)) for s in pack])], np.int64),
        "packed_mask": (seg[:, None] == seg[None, :]).astype(np.int64)[None],
        "pool": np.stack([(seg == i) / len(s) for i, s in enumerate(pack)]).astype(np.float32),
    }
    return session, ["packed_embeddings"], feed


def padded_feed(session: ort.InferenceSession, batch: list[list[int]]) -> Feed:
    ids, mask = pad([np.asarray(s) for s in batch], pad_id=0)  # the batcher's padding
    return session, ["embeddings"], {"input_ids": ids, "attention_mask": mask}


def main(rounds: int, cap: int) -> None:
    path = glob.glob("models/all-minilm-l6-v2/*/model.optimized.onnx")[-1]
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    packed = ort.InferenceSession(packed_graph(path).SerializeToString(), options, providers=["CPUExecutionProvider"])
    plain = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    tok = load_for_serving(glob.glob("models/all-minilm-l6-v2/*/tokenizer.json")[-1], 256)

    worst = 0.0
    for start in range(0, 400, 8):
        for pack in packs([e.ids for e in tok.encode_batch(SHORT_TEXTS[start : start + 8])], cap):
            s, outs, feed = packed_feed(packed, pack)
            got = s.run(outs, feed)[0]
            s, outs, feed = padded_feed(plain, pack)
            worst = max(worst, float(np.abs(got - s.run(outs, feed)[0]).max()))
    print(f"packed against padded, 400 short texts, packs of up to 8 texts and {cap} tokens: "
          f"max abs difference {worst:.2e}")  # fmt: skip

    seqs = [e.ids for e in tok.encode_batch(SHORT_TEXTS)]
    random.Random(2).shuffle(seqs)
    by_length = sorted(seqs, key=len)
    plans: dict[str, list[Feed]] = {
        f"sorted by length, padded, batch {b}": [padded_feed(plain, by_length[i : i + b]) for i in range(0, 2000, b)]
        for b in (4, 16)
    }
    plans["arrival order, padded, batch 4"] = [padded_feed(plain, seqs[i : i + 4]) for i in range(0, 2000, 4)]
    for k in (4, 8, 16):
        plans[f"arrival order, packed, {k} texts a run"] = [
            packed_feed(packed, p) for i in range(0, 2000, k) for p in packs(seqs[i : i + k], cap)
        ]
    rates: dict[str, list[float]] = {name: [] for name in plans}
    for _ in range(rounds):
        for name, feeds in plans.items():
            t0 = time.perf_counter()
            for session, outs, feed in feeds:
                session.run(outs, feed)
            rates[name].append(len(seqs) / (time.perf_counter() - t0))
    print(f"seq/s, medians of {rounds} rounds (packs of at most {cap} tokens):")
    for name, v in rates.items():
        print(f"  {name:40s} {statistics.median(v):6.1f}  ({', '.join(f'{x:.1f}' for x in v)})")


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
