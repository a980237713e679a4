#!/usr/bin/env python3
"""An fp8 linear layer written from docs/fp8.md with numpy and ml_dtypes, independently of teo's
kernels, judged by `teo golden check --precision fp8` on every linear fp8 op case.

For each golden/ops/linear_fp8_*.safetensors case it reads the inputs (with the delayed scales
input.fp8_scale.* where the case gives them) and the recipe (__metadata__.spec), computes output.y, grad.input.x, grad.param.weight and grad.param.bias as
the recipe defines them, writes them as float32 and runs the checker. Its own loops, not teo's:
products are summed in float64 where teo sums in float32 (a limited accumulator is modelled with
frexp), and ml_dtypes does the fp8 and bf16 casts.

Usage (with the project's virtual environment, where ml_dtypes is installed):
  .venv/bin/python tests/interop/fp8_linear.py TEO_BINARY GOLDEN_OPS_DIR WORK_DIR
Exits 1 when a case fails or none is found.
"""

import glob
import json
import os
import struct
import subprocess
import sys

import ml_dtypes
import numpy as np

FP8 = {"e4m3": (ml_dtypes.float8_e4m3fn, 448.0, 8), "e5m2": (ml_dtypes.float8_e5m2, 57344.0, 15)}
NP = {"F32": np.float32, "F64": np.float64, "I64": np.int64}


def read(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    meta = header.pop("__metadata__", {})
    out = {}
    for name, t in header.items():
        a, b = t["data_offsets"]
        out[name] = np.frombuffer(data[a:b], dtype=NP[t["dtype"]]).reshape(t["shape"])
    return out, meta


def write(path, tensors):
    header, blobs, off = {}, [], 0
    for name, a in tensors.items():
        b = np.ascontiguousarray(a, dtype=np.float32).tobytes()
        header[name] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path + ".tmp", "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))
    os.replace(path + ".tmp", path)


def bf16(x):
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def quantize(x, fmt, scaling, tile_rows, block_k, given=None):
    """x (rows, k) float32 -> (q * d as float64, the fp8 values), d per tile of the recipe; a
    delayed scale `given` (one per tensor) quantizes x / d instead."""
    dtype, fmax, emax = FP8[fmt]
    rows, k = x.shape
    if given is not None:
        d = np.float32(given)
        q = np.clip(x / d, -fmax, fmax).astype(dtype).astype(np.float64)
        return q * np.float64(d)
    if scaling == "tensor":
        tile_rows, block_k = rows, k
    elif scaling == "mx":
        tile_rows, block_k = 1, 32
    value = np.zeros((rows, k))
    for r0 in range(0, rows, tile_rows):
        for k0 in range(0, k, block_k):
            t = x[r0:r0 + tile_rows, k0:k0 + block_k]
            amax = np.float32(np.max(np.abs(t))) if t.size else np.float32(0)
            if scaling == "mx":
                e = int(np.frexp(amax)[1]) - 1 - emax if amax > 0 else -127
                mul = np.float32(2.0 ** -e)
                d = 2.0 ** e
            else:
                mul = np.float32(fmax) / amax if amax > 0 else np.float32(1)
                d = 1.0 / np.float64(mul)
            s = np.clip(t * mul, -fmax, fmax)  # saturate, then round to nearest even
            q = s.astype(dtype).astype(np.float64)
            value[r0:r0 + tile_rows, k0:k0 + block_k] = q * d
    return value


def truncate(x, bits):
    m, e = np.frexp(x)
    return np.ldexp(np.trunc(m * 2.0 ** (bits + 1)) / 2.0 ** (bits + 1), e)


def product(a, b, r, blocks):
    """a (m, k) @ b (n, k)^T of dequantized operands; a limited accumulator truncates its running
    sum to fp8_mantissa_bits after every add and promotes every fp8_promote_every products and
    at every scale block's end."""
    if r["fp8_accumulate"] != "limited":
        return a @ b.T
    k = a.shape[1]
    every = r["fp8_promote_every"] or k
    total = np.zeros((a.shape[0], b.shape[0]))
    part = np.zeros_like(total)
    count = 0
    for p in range(k):
        part = truncate(part + np.outer(a[:, p], b[:, p]), r["fp8_mantissa_bits"])
        count += 1
        if count == every or (p + 1) % blocks == 0 or p + 1 == k:
            total += part
            part[:] = 0
            count = 0
    return total


def linear(t, r):
    fwd = "e4m3" if r["fp8_format"] in ("e4m3", "hybrid") else "e5m2"
    bwd = "e5m2" if r["fp8_format"] in ("e5m2", "hybrid") else "e4m3"
    sc, bk, wb = r["fp8_scaling"], r["fp8_block_k"], r["fp8_weight_block"]
    x, w = bf16(t["input.x"]), bf16(t["param.weight"])
    g = bf16(t["grad.output.y"])
    delayed = r.get("fp8_scales") == "delayed"  # the case's scales (input.fp8_scale.*)
    sx, sw, sg = ((t["input.fp8_scale." + n][0] for n in ("x", "weight", "grad_y")) if delayed
                  else (None, None, None))
    blocks_k = lambda k: k if sc == "tensor" else (32 if sc == "mx" else bk)  # noqa: E731
    out = {}
    y = product(quantize(x, fwd, sc, 1, bk, sx), quantize(w, fwd, sc, wb, bk, sw), r,
                blocks_k(x.shape[1]))
    if "param.bias" in t:
        y = y.astype(np.float32) + bf16(t["param.bias"])
    out["output.y"] = bf16(y)
    dx = product(quantize(g, bwd, sc, 1, bk, sg), quantize(w.T.copy(), fwd, sc, wb, bk, sw), r,
                 blocks_k(g.shape[1]))
    out["grad.input.x"] = bf16(dx)
    dw = product(quantize(g.T.copy(), bwd, sc, 1, bk, sg), quantize(x.T.copy(), fwd, sc, 1, bk, sx),
                 r, blocks_k(g.shape[0]))
    out["grad.param.weight"] = bf16(dw)
    if "param.bias" in t:
        out["grad.param.bias"] = bf16(np.sum(g.astype(np.float64), axis=0))
    return out


def check(teo, golden, work, tensors):
    """Writes `tensors` as the candidate of the op case at `golden` (in `work`) and runs
    `teo golden check --precision fp8 --require-all` on it: (passed, the checker's output, its JSON
    report's tensor rows, its first divergence)."""
    cand = os.path.join(work, os.path.basename(golden))
    write(cand, tensors)
    report = cand + ".json"
    p = subprocess.run([teo, "golden", "check", "--golden", golden, "--candidate", cand,
                        "--precision", "fp8", "--require-all", "--json", report],
                       capture_output=True, text=True)
    rows, first = [], ""
    if os.path.exists(report):
        rep = json.load(open(report))
        rows = [x for c in rep["cases"] for x in c["tensors"]]
        first = rep["cases"][0].get("first_divergence") or ""
    return p.returncode == 0, p.stdout + p.stderr, rows, first


def main(argv):
    teo, golden_dir, work = argv[1:4]
    os.makedirs(work, exist_ok=True)
    cases = sorted(glob.glob(os.path.join(golden_dir, "linear_fp8_*.safetensors")))
    if not cases:
        print("no linear fp8 op case in " + golden_dir)
        return 1
    failures = 0
    for path in cases:
        t, meta = read(path)
        passed, output, ts, _ = check(teo, path, work, linear(t, json.loads(meta["spec"])))
        worst = ""
        if ts:
            worst = "worst ratio %.3g, worst recipe distance %.3g" % (
                max(x.get("ratio") or 0 for x in ts), max(x.get("recipe_distance") or 0 for x in ts))
        print("%-40s %s %s" % (os.path.basename(path), "pass" if passed else "FAIL", worst))
        if not passed:
            failures += 1
            print(output)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
