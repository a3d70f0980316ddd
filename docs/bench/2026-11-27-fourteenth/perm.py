"""Whether ONNX Runtime asked Linux for the AMX tiles: the process's permitted extended-state features
(arch_prctl ARCH_GET_XCOMP_PERM) after `import onnxruntime` and after a session of GRAPH. Bit 18 is the tile data.
Run from the repository root: python perm.py GRAPH (with LD_PRELOAD=noamx.so: the request refused)."""

import ctypes
import sys

import onnxruntime as ort

libc = ctypes.CDLL(None, use_errno=True)


def perm() -> int:
    features = ctypes.c_ulong(0)
    libc.syscall(158, 0x1022, ctypes.byref(features))  # SYS_arch_prctl, ARCH_GET_XCOMP_PERM
    return features.value


print("after import", hex(perm()))
session = ort.InferenceSession(sys.argv[1], providers=["CPUExecutionProvider"])
print("after session", hex(perm()), "bit 18 (XTILEDATA) =", bool(perm() & (1 << 18)))
