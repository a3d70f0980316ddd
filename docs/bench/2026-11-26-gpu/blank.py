"""Blank the cubins for every GPU architecture but sm_90 in a CUDA library's .nv_fatbin section.

Used once, to carry onnxruntime-gpu's CUDA provider (271 MB, 185 MB compressed) to the H200 within the
device tool's 64 MiB per call: with the other architectures' code zeroed it compresses to 51 MB. The sm_90
entries and every header stay byte for byte; a Hopper GPU (compute capability 9.0) can load only sm_90
cubins (the library ships no PTX), so it never reads the blanked ones.

Run: python blank.py libonnxruntime_providers_cuda.so out.so
"""

import struct
import subprocess
import sys
from pathlib import Path

FATBIN_MAGIC = 0xBA55ED50


def nv_fatbin_section(path: str) -> tuple[int, int]:
    for line in subprocess.check_output(["readelf", "-S", "-W", path], text=True).splitlines():
        if ".nv_fatbin" in line:
            fields = line.split("]")[1].split()
            return int(fields[3], 16), int(fields[4], 16)
    raise SystemExit(f"{path} has no .nv_fatbin section")


def main(src: str, dst: str) -> None:
    data = bytearray(Path(src).read_bytes())
    offset, size = nv_fatbin_section(src)
    at, end = offset, offset + size
    kept = blanked = 0
    while at < end:
        magic, _version, header_size, fat_size = struct.unpack_from("<IHHQ", data, at)
        if magic != FATBIN_MAGIC:  # padding between fat binaries
            at += 8
            continue
        entry, fat_end = at + header_size, at + header_size + fat_size
        while entry < fat_end:
            _kind, _entry_version, entry_header, payload = struct.unpack_from("<HHIQ", data, entry)
            arch = struct.unpack_from("<I", data, entry + 28)[0]
            start = entry + entry_header
            if arch == 90:
                kept += payload
            else:
                data[start : start + payload] = bytes(payload)
                blanked += payload
            entry = start + payload
        if entry != fat_end:
            raise SystemExit(f"fat binary at {at:#x}: entries end at {entry:#x}, not {fat_end:#x}")
        at = fat_end
    Path(dst).write_bytes(data)
    print(f"kept {kept / 1e6:.1f} MB of sm_90 entries, blanked {blanked / 1e6:.1f} MB")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
