"""What gguf_blocks.py and quant_formats.py share: the failures a run collects, running the teo
binary with an expected exit status, and a plain safetensors reader and writer (numpy arrays,
F8_E4M3 read as its bytes)."""

import json
import struct
import subprocess

import numpy as np

FAILURES = []
DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I32": np.int32, "I8": np.int8,
          "U8": np.uint8, "F8_E4M3": np.uint8, "I64": np.int64}
NAMES = {np.dtype(v): k for k, v in DTYPES.items() if k != "F8_E4M3"}


def fail(msg):
    FAILURES.append(msg)
    print("FAIL:", msg)


def run(cmd, expect=0):
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != expect:
        fail(f"{' '.join(cmd[1:4])} exited {p.returncode}, expected {expect}: {p.stderr.strip()}")
    return p


def read_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    header.pop("__metadata__", None)
    return {k: np.frombuffer(data[t["data_offsets"][0]:t["data_offsets"][1]], DTYPES[t["dtype"]])
            .reshape(t["shape"]) for k, t in header.items()}


def write_safetensors(path, tensors, dtypes=None):
    """`dtypes` names the dtype of a tensor its numpy type does not say (F8_E4M3 as uint8)."""
    header, data = {}, b""
    for k, v in tensors.items():
        raw = np.ascontiguousarray(v).tobytes()
        header[k] = {"dtype": (dtypes or {}).get(k, NAMES[v.dtype]), "shape": list(v.shape),
                     "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + data)
