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
NP = {"F32": np.float32, "F64": np.float64, "I64": np.int64, "F8_E4M3": ml_dtypes.float8_e4m3fn,
      "F8_E5M2": ml_dtypes.float8_e5m2}


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


def block_of(scaling, tile_rows, block_k, rows, k):
    """The block one scale covers: the whole operand, tile_rows x block_k, or MX's 1 x 32."""
    if scaling == "tensor":
        return max(rows, 1), max(k, 1)
    return (1, 32) if scaling == "mx" else (tile_rows, block_k)


def quantize(x, fmt, scaling, tile_rows, block_k, given=None, parts=False):
    """x (rows, k) float32 -> q * d as float64, d per block of the recipe; a delayed scale `given`
    (one per tensor) quantizes x / d instead. With `parts`, also the fp8 values q and the float32
    dequantization scales per block as teo stores them (amax / fp8_max, MX's 2^e, the given)."""
    dtype, fmax, emax = FP8[fmt]
    rows, k = x.shape
    if given is not None:
        d = np.float32(given)
        q = np.clip(x / d, -fmax, fmax).astype(dtype)
        value = q.astype(np.float64) * np.float64(d)
        return (value, q, np.full((1, 1), d, np.float32)) if parts else value
    tile_rows, block_k = block_of(scaling, tile_rows, block_k, rows, k)
    value = np.zeros((rows, k))
    qs = np.zeros((rows, k), dtype)
    scales = np.zeros((-(-rows // tile_rows), -(-k // block_k)), np.float32)
    for r0 in range(0, rows, tile_rows):
        for k0 in range(0, k, block_k):
            t = x[r0:r0 + tile_rows, k0:k0 + block_k]
            amax = np.float32(np.max(np.abs(t))) if t.size else np.float32(0)
            if scaling == "mx":
                e = int(np.frexp(amax)[1]) - 1 - emax if amax > 0 else -127
                mul = np.float32(2.0 ** -e)
                d = 2.0 ** e
                stored = np.float32(d)
            else:
                mul = np.float32(fmax) / amax if amax > 0 else np.float32(1)
                d = 1.0 / np.float64(mul)
                stored = amax / np.float32(fmax) if amax > 0 else np.float32(1)
            s = np.clip(t * mul, -fmax, fmax)  # saturate, then round to nearest even
            q = s.astype(dtype)
            qs[r0:r0 + tile_rows, k0:k0 + block_k] = q
            value[r0:r0 + tile_rows, k0:k0 + block_k] = q.astype(np.float64) * d
            scales[r0 // tile_rows, k0 // block_k] = stored
    return (value, qs, scales) if parts else value


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


def formats(r):
    """The forward and the output gradient's fp8 formats."""
    return ("e4m3" if r["fp8_format"] in ("e4m3", "hybrid") else "e5m2",
            "e5m2" if r["fp8_format"] in ("e5m2", "hybrid") else "e4m3")


def operands(t, r):
    """The three products' six operands, each (rows, k) along its contraction and named as teo
    stores them (fp8.<name>): {name: (values, format, tile rows, delayed scale or None)}."""
    fwd, bwd = formats(r)
    wb = r["fp8_weight_block"]
    x, w, g = bf16(t["input.x"]), bf16(t["param.weight"]), bf16(t["grad.output.y"])
    delayed = r.get("fp8_scales") == "delayed"  # the case's scales (input.fp8_scale.*)
    sx, sw, sg = ((t["input.fp8_scale." + n][0] for n in ("x", "weight", "grad_y")) if delayed
                  else (None, None, None))
    return {"y.x": (x, fwd, 1, sx), "y.weight": (w, fwd, wb, sw),
            "grad_x.grad_y": (g, bwd, 1, sg), "grad_x.weight": (w.T.copy(), fwd, wb, sw),
            "grad_weight.grad_y": (g.T.copy(), bwd, 1, sg), "grad_weight.x": (x.T.copy(), fwd, 1, sx)}


# Each product's result and its two operands: result = a @ b^T.
PRODUCTS = (("output.y", "y.x", "y.weight"), ("grad.input.x", "grad_x.grad_y", "grad_x.weight"),
            ("grad.param.weight", "grad_weight.grad_y", "grad_weight.x"))


def linear(t, r, values=None):
    """The linear case's results from the dequantized operands `values` ({name: q * d}), by
    default this file's own quantization of the case's inputs."""
    sc, bk = r["fp8_scaling"], r["fp8_block_k"]
    if values is None:
        values = {n: quantize(a, f, sc, tr, bk, d) for n, (a, f, tr, d) in operands(t, r).items()}
    out = {}
    for name, a, b in PRODUCTS:
        k = values[a].shape[1]
        y = product(values[a], values[b], r, block_of(sc, 1, bk, 1, k)[1])
        if name == "output.y" and "param.bias" in t:
            y = y.astype(np.float32) + bf16(t["param.bias"])
        out[name] = bf16(y)
    if "param.bias" in t:
        out["grad.param.bias"] = bf16(np.sum(bf16(t["grad.output.y"]).astype(np.float64), axis=0))
    return out


def check(teo, golden, work, tensors):
    """Writes `tensors` as the candidate of the op case at `golden` (in `work`) and runs
    `teo golden check --precision fp8 --require-all` on it: (passed, the checker's output, its JSON
    report's tensor rows, its first divergence)."""
    os.makedirs(work, exist_ok=True)
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


def op_cases(golden_dir, pattern, work):
    """The op cases of golden_dir matching `pattern`, sorted (creating `work`); exits 1 saying so
    when there is none."""
    os.makedirs(work, exist_ok=True)
    found = sorted(glob.glob(os.path.join(golden_dir, pattern)))
    if not found:
        raise SystemExit("no op case %s in %s" % (pattern, golden_dir))
    return found


def verdict(path, passed, rows):
    """A case's line: its file, pass or FAIL, the worst ratio and recipe distance of its tensors."""
    worst = ""
    if rows:
        worst = "worst ratio %.3g, worst recipe distance %.3g" % (
            max(x.get("ratio") or 0 for x in rows), max(x.get("recipe_distance") or 0 for x in rows))
    return "%-40s %s %s" % (os.path.basename(path), "pass" if passed else "FAIL", worst)


def main(argv):
    teo, golden_dir, work = argv[1:4]
    failures = 0
    for path in op_cases(golden_dir, "linear_fp8_*.safetensors", work):
        t, meta = read(path)
        passed, output, ts, _ = check(teo, path, work, linear(t, json.loads(meta["spec"])))
        print(verdict(path, passed, ts))
        if not passed:
            failures += 1
            print(output)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
