import sys
from pathlib import Path

from mhaserve.export.quantize import Int8Plan, quantize

d = Path("models/all-minilm-l6-v2/1")
plan = Int8Plan(row_scaled=tuple(sys.argv[2].split(",")))
print(quantize(d / "model.optimized.onnx", Path(sys.argv[1]), plan))
