#!/usr/bin/env python3
"""teo's stored fp8 operands (`teo golden op --keep '*'`; docs/golden-format.md, "fp8 operands")
against fp8_linear.py's numpy/ml_dtypes recipe, and a backend fed them.

For each golden/ops/linear_fp8_*.safetensors case it writes the case again from its spec with the
quantized operands of its three products (fp8.<name> as F8_E4M3 or F8_E5M2, fp8.<name>.scale as
float32), then
- checks every stored fp8 byte and every scale against the numpy quantization of the case's
  inputs, bit for bit;
- computes the products from the stored operands alone (q times its block's scale, summed in
  float64, or in the limited accumulator the case asks for) and runs the checker on them: a
  backend fed teo's fp8 values is judged on its arithmetic alone, so its recipe distance is
  printed next to the ratio.

Usage (with the project's virtual environment, where ml_dtypes is installed):
  .venv/bin/python tests/interop/fp8_kept.py TEO_BINARY GOLDEN_OPS_DIR WORK_DIR
Exits 1 when an operand differs, a case fails, or none is found.
"""

import json
import os
import subprocess
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fp8_linear as fl  # noqa: E402


def dequantized(q, scale, block):
    """q (rows, k) times the scale of its block, as float64."""
    rows, k = q.shape
    br, bk = block
    d = np.repeat(np.repeat(scale.astype(np.float64), br, axis=0), bk, axis=1)[:rows, :k]
    return q.astype(np.float64) * d


def kept_case(teo, path, work):
    """Writes the case at `path` again with its fp8 operands; returns its tensors and spec."""
    _, meta = fl.read(path)
    spec = os.path.join(work, os.path.basename(path) + ".spec.json")
    with open(spec, "w") as f:
        f.write(meta["spec"])
    out = os.path.join(work, os.path.basename(path) + ".kept.safetensors")
    p = subprocess.run([teo, "golden", "op", "--spec", spec, "--out", out, "--keep", "*",
                        "--force"], capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit("teo golden op --keep '*' failed on %s:\n%s" % (path, p.stdout + p.stderr))
    t, meta = fl.read(out)
    committed, _ = fl.read(path)
    for name, a in committed.items():  # the same case: its inputs and results, bit for bit
        if not np.array_equal(a.view(np.uint8), t[name].view(np.uint8)):
            raise SystemExit("%s: %s written again differs from the committed one" % (path, name))
    return out, t, json.loads(meta["spec"])


def main(argv):
    teo, golden_dir, work = argv[1:4]
    failures = 0
    for path in fl.op_cases(golden_dir, "linear_fp8_*.safetensors", work):
        out, t, r = kept_case(teo, path, work)
        sc, bk = r["fp8_scaling"], r["fp8_block_k"]
        values, differ = {}, []
        for name, (a, fmt, tile_rows, given) in fl.operands(t, r).items():
            _, q, scale = fl.quantize(a, fmt, sc, tile_rows, bk, given, parts=True)
            kq, ks = t["fp8." + name], t["fp8." + name + ".scale"]
            if kq.dtype != q.dtype or kq.shape != q.shape or ks.shape != scale.shape:
                differ.append("%s: teo %s %s, scale %s; numpy %s %s, scale %s" % (
                    name, kq.dtype, kq.shape, ks.shape, q.dtype, q.shape, scale.shape))
                continue
            bits = np.count_nonzero(kq.view(np.uint8) != q.view(np.uint8))
            sbits = np.count_nonzero(ks.view(np.uint32) != scale.view(np.uint32))
            if bits or sbits:
                differ.append("%s: %d of %d fp8 values and %d of %d scales differ" % (
                    name, bits, q.size, sbits, scale.size))
            values[name] = dequantized(kq, ks, fl.block_of(sc, tile_rows, bk, *a.shape))
        if differ:
            failures += 1
            print("%-40s FAIL: the stored operands are not numpy's" % os.path.basename(path))
            print("\n".join("  " + d for d in differ))
            continue
        passed, output, ts, _ = fl.check(teo, out, os.path.join(work, "candidates"),
                                         fl.linear(t, r, values))
        print(fl.verdict(path, passed, ts))
        if not passed:
            failures += 1
            print(output)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
