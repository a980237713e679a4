#!/usr/bin/env python3
"""teo's quantized safetensors formats against a numpy dequantization written here from each
format's reference description (not from teo's code), bit for bit, with mutants.

For int8, GPTQ (v1 and v2, act-order), AWQ, MXFP4 (gpt-oss's layout) and NVFP4 (ModelOpt's),
`teo quant quantize` packs random weights and `teo quant dequantize` unpacks them to float64. The
numpy dequantization below must give the same bits for every weight. Each mutant (one layout rule
broken, as the bugs reported in vLLM, TensorRT-LLM and llama.cpp broke them) must differ at its own
weight and agree at the others. Checkpoints with an E8M0 or E4M3 NaN scale or a g_idx outside the
groups must be refused by name. The corpus's quantized model cases must hold each quantized weight
as the numpy dequantization of its packed tensors (quant.*), with no gradient, and every layout
mutant but E2M1's -0 (teo's quantizer writes none) must differ from them.

Sources of the layouts: AutoGPTQ's and Hugging Face's `gptq` (qweight packed 8 a word along the
input dimension, qzeros along the output, zero + 1 in v1), AutoAWQ's GEMM packing (AWQ_ORDER
0, 2, 4, 6, 1, 3, 5, 7 along the output dimension), OCP Microscaling v1.0 (E2M1, E8M0) with
transformers' gpt-oss unpacking (low nibble first), NVIDIA ModelOpt's NVFP4 (E2M1 pairs, E4M3 per
16, FP32 weight_scale_2).

Usage: .venv/bin/python tests/interop/quant_formats.py TEO_BINARY WORK_DIR
"""

import os
import sys

import numpy as np
from interop_io import FAILURES, fail, run
from interop_io import read_safetensors as read
from interop_io import write_safetensors as write

E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float64)
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # nibble k of a word holds column AWQ_ORDER[k]







def e4m3(b):
    """OCP E4M3 ("fn") bytes as float64: bias 7, subnormals, NaN at S.1111.111."""
    b = b.astype(np.int64)
    e, m = (b >> 3) & 15, b & 7
    v = np.where(e == 0, m * 2.0 ** -9, (8 + m) * 2.0 ** (e - 10))
    v = np.where((e == 15) & (m == 7), np.nan, v)
    return np.where(b & 0x80, -v, v)


def nibbles(words, k):
    return (words.view(np.uint32) >> np.uint32(4 * k)) & np.uint32(15)


# --- the dequantizations, from the descriptions; `mut` breaks one rule ------------------------
def int8(t, p, mut=None):
    q = t[p + ".weight"].astype(np.float64)
    s = t[p + ".weight_scale"].astype(np.float64).reshape(-1)
    if mut == "int8_scale_per_column" and q.shape[0] == q.shape[1]:
        return q * s[:q.shape[1]][None, :]
    return q * s[:, None]


def int4(t, p, kind, zero_offset=1, mut=None):
    qw, qz = t[p + ".qweight"], t[p + ".qzeros"]
    s = t[p + ".scales"].astype(np.float64)
    groups, rows = s.shape
    if kind == "gptq":
        cols = qw.shape[0] * 8
        q = np.stack([nibbles(qw, k) for k in range(8)], 1).reshape(cols, rows)  # (cols, rows)
        z = np.stack([nibbles(qz, k) for k in range(8)], 2).reshape(groups, rows)
        if mut == "gptq_without_plus_one":
            zero_offset = 0
        if mut == "gptq_plus_one_on_v2":
            zero_offset = 1
        z = z.astype(np.int64) + zero_offset
        g = t.get(p + ".g_idx")
        g = np.arange(cols) // (cols // groups) if g is None or mut == "g_idx_ignored" else g
    else:
        cols = qw.shape[0]
        order = list(range(8)) if mut == "awq_without_interleave" else AWQ_ORDER
        q = np.zeros((cols, rows), np.int64)
        z = np.zeros((groups, rows), np.int64)
        for k in range(8):
            q[:, order[k]::8] = nibbles(qw, k)
            z[:, order[k]::8] = nibbles(qz, k)
        g = np.arange(cols) // (cols // groups)
    if mut == "group_scales_along_rows" and rows == cols:
        sg = s[np.arange(rows) * groups // rows][:, :cols]  # groups taken over the output rows
        return (sg * (q.T.astype(np.int64) - z[g].T)).astype(np.float64)
    return s[g].T * (q.T.astype(np.int64) - z[g].T)


def mxfp4(t, p, mut=None):
    b, e = t[p + "_blocks"], t[p + "_scales"].astype(np.int64)
    lo, hi = b & 15, b >> 4
    if mut == "mxfp4_nibbles_swapped":
        lo, hi = hi, lo
    codes = np.stack([lo, hi], -1).reshape(*b.shape[:-1], 32)
    table = E2M1.copy()
    if mut == "e2m1_negative_zero_nonzero":
        table[8] = -0.5
    v = np.ldexp(table[codes], (e - 127)[..., None])
    return v.reshape(*e.shape[:-1], e.shape[-1] * 32)


def nvfp4(t, p, mut=None):
    w = t[p + ".weight"]
    lo, hi = (w >> 4, w & 15) if mut == "nvfp4_nibbles_swapped" else (w & 15, w >> 4)
    codes = np.stack([lo, hi], -1).reshape(w.shape[0], -1)
    block = 32 if mut == "nvfp4_block_of_32" else 16  # TensorRT-LLM #14793's wrong block size
    s = e4m3(t[p + ".weight_scale"]).repeat(block, axis=1)[:, :codes.shape[1]]
    g = float(t[p + ".weight_scale_2"].reshape(-1)[0])
    v = E2M1[codes] * s * g
    return v * g if mut == "nvfp4_global_scale_twice" else v


# Each case: (format, extra teo flags, numpy dequantization, its mutants).
CASES = {
    "int8": ("int8", [], lambda t, p, m=None: int8(t, p, m), ["int8_scale_per_column"]),
    "gptq_v1_act_order": ("gptq", ["--group-size", "32", "--act-order", "--seed", "5"],
                          lambda t, p, m=None: int4(t, p, "gptq", 1, m),
                          ["gptq_without_plus_one", "g_idx_ignored", "group_scales_along_rows"]),
    "gptq_v2": ("gptq", ["--group-size", "32", "--zero-offset", "0"],
                lambda t, p, m=None: int4(t, p, "gptq", 0, m), ["gptq_plus_one_on_v2"]),
    "awq": ("awq", ["--group-size", "32"], lambda t, p, m=None: int4(t, p, "awq", 0, m),
            ["awq_without_interleave", "group_scales_along_rows"]),
    "mxfp4": ("mxfp4", [], lambda t, p, m=None: mxfp4(t, p, m),
              ["mxfp4_nibbles_swapped", "e2m1_negative_zero_nonzero"]),
    "nvfp4": ("nvfp4", [], lambda t, p, m=None: nvfp4(t, p, m),
              ["nvfp4_global_scale_twice", "nvfp4_nibbles_swapped", "nvfp4_block_of_32"]),
}


def first_difference(want, got):
    if want.shape != got.shape:
        return f"shape {list(want.shape)} against {list(got.shape)}"
    w, g = want.reshape(-1).view(np.uint64), np.ascontiguousarray(got).reshape(-1).view(np.uint64)
    bad = np.nonzero(w != g)[0]
    if bad.size == 0:
        return ""
    i = int(bad[0])
    return (f"{bad.size} of {w.size} values differ, first at {np.unravel_index(i, want.shape)}: "
            f"numpy {want.reshape(-1)[i]!r}, teo {got.reshape(-1)[i]!r}")


# The corpus's quantized model cases: each weight's packed parts (quant.<weight>.<role>) and the
# format's numpy dequantization, which must be the golden's param.<weight> bit for bit.
MODELS = {"quant_llama_gptq_f64": "gptq_v1_act_order", "quant_llama_awq_f32": "awq",
          "quant_llama_nvfp4_f64": "nvfp4", "quant_gpt_oss_mxfp4_f64": "mxfp4"}


def models():
    corpus = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "golden")
    for name, case in MODELS.items():
        fmt, _, deq, mutants = CASES[case]
        t = read(os.path.join(corpus, name + ".safetensors"))
        params = [k[len("param."):] for k in t if k.startswith("param.")]
        if fmt == "mxfp4":
            weights = [p for p in params if "quant." + p + "_blocks" in t]
        else:
            weights = [p for p in params if p.endswith(".weight") and any(
                k.startswith("quant." + p[:-7] + ".") for k in t)]
        if not weights:
            fail(f"{name}: no packed weight")
            continue
        module = (lambda p: "quant." + p) if fmt == "mxfp4" else (lambda p: "quant." + p[:-7])
        for p in weights:
            want = t["param." + p].astype(np.float64)
            diff = first_difference(deq(t, module(p)), want)
            if diff:
                fail(f"{name} {p}: {diff}")
            if "grad." + p in t:
                fail(f"{name}: a quantized weight has a gradient, grad.{p}")
        print(f"{name}: {len(weights)} weights, numpy's values are the golden's bit for bit")
        # teo's quantizer writes no E2M1 -0, so that mutant is judged on the drawn codes above only
        for m in [m for m in mutants if m != "e2m1_negative_zero_nonzero"]:
            if not any(first_difference(deq(t, module(p), m), t["param." + p].astype(np.float64))
                       for p in weights):
                fail(f"{name}: mutant {m} agrees with the golden")
            else:
                print(f"  mutant {m}: differs")


def main():
    teo, work = sys.argv[1], sys.argv[2]
    os.makedirs(work, exist_ok=True)
    rng = np.random.default_rng(52)
    weights = os.path.join(work, "weights.safetensors")
    # A square weight (for the wrong-axis mutant), a wide one, and gpt-oss-style stacked experts.
    w = {"a.weight": rng.standard_normal((64, 64)).astype(np.float32) * 0.05,
         "b.weight": rng.standard_normal((32, 128)).astype(np.float32) * 0.02}
    write(weights, w)
    experts = os.path.join(work, "experts.safetensors")
    write(experts, {"experts.gate_up_proj": rng.standard_normal((2, 16, 64)).astype(np.float32)})
    for case, (fmt, flags, deq, mutants) in CASES.items():
        src = experts if fmt == "mxfp4" else weights
        packed, out = os.path.join(work, f"{case}.safetensors"), os.path.join(work, f"{case}_deq")
        run([teo, "quant", "quantize", src, "--format", fmt, "--out", packed, "--force", *flags])
        if fmt in ("mxfp4", "nvfp4"):
            # Every 4-bit code, -0 (which teo's quantizer never writes) among them, as another
            # quantizer may write them: the codes drawn, the scales drawn finite.
            t = read(packed)
            codes = "experts.gate_up_proj_blocks" if fmt == "mxfp4" else None
            for k in list(t):
                v = t[k]
                if k == codes or (fmt == "nvfp4" and k.endswith(".weight")):
                    t[k] = rng.integers(0, 256, v.shape, dtype=np.uint8)
                elif fmt == "nvfp4" and k.endswith(".weight_scale"):
                    t[k] = rng.integers(0, 0x7F, v.shape, dtype=np.uint8)  # E4M3 below NaN
            write(packed, t, {k: "F8_E4M3" for k in t if k.endswith(".weight_scale")})
        zero = ["--zero-offset", "0"] if case == "gptq_v2" else []
        run([teo, "quant", "dequantize", packed, "--format", fmt, "--out", out, "--force", *zero])
        if FAILURES:
            return 1
        t, got = read(packed), read(out)
        names = [k[:-7] for k in got] if fmt != "mxfp4" else list(got)
        for p in names:
            key = p if fmt == "mxfp4" else p + ".weight"
            diff = first_difference(deq(t, p), got[key])
            if diff:
                fail(f"{case} {p}: {diff}")
        print(f"{case}: {len(names)} weights, numpy's values are teo's bit for bit")
        for m in mutants:
            bad = [p for p in names if first_difference(deq(t, p, m), got[
                p if fmt == "mxfp4" else p + ".weight"])]
            square_only = ("group_scales_along_rows", "int8_scale_per_column")
            expect = ["a"] if m in square_only else names
            if bad != expect:
                fail(f"mutant {m}: differs at {bad}, expected {expect}")
            else:
                print(f"  mutant {m}: fails at {', '.join(bad)}")
    # Refused by name: an E8M0 NaN scale, an E4M3 NaN scale, a g_idx outside the groups.
    t = read(os.path.join(work, "mxfp4.safetensors"))
    bad = os.path.join(work, "bad.safetensors")
    s = t["experts.gate_up_proj_scales"].copy()
    s.reshape(-1)[3] = 0xFF
    write(bad, {"experts.gate_up_proj_blocks": t["experts.gate_up_proj_blocks"],
                "experts.gate_up_proj_scales": s})
    p = run([teo, "quant", "dequantize", bad, "--format", "mxfp4", "--out", bad + ".out"], 2)
    if "element 3 is 0xff" not in p.stderr:
        fail(f"E8M0 0xff not named: {p.stderr.strip()}")
    print("refused: " + p.stderr.strip())
    t = read(os.path.join(work, "nvfp4.safetensors"))
    s = t["a.weight_scale"].copy()
    s.reshape(-1)[7] = 0x7F  # E4M3's NaN
    write(bad, {**t, "a.weight_scale": s}, {k: "F8_E4M3" for k in t if k.endswith("_scale")})
    p = run([teo, "quant", "dequantize", bad, "--format", "nvfp4", "--out", bad + ".out"], 2)
    if "a.weight_scale element 7" not in p.stderr or "not a finite scale" not in p.stderr:
        fail(f"E4M3 NaN not named: {p.stderr.strip()}")
    print("refused: " + p.stderr.strip())
    t = read(os.path.join(work, "gptq_v1_act_order.safetensors"))
    g = t["a.g_idx"].copy()
    g[5] = 99
    write(bad, {**t, "a.g_idx": g})
    p = run([teo, "quant", "dequantize", bad, "--format", "gptq", "--out", bad + ".out"], 2)
    if "a.g_idx[5] is 99, outside the 2 groups" not in p.stderr:
        fail(f"g_idx outside the groups not named: {p.stderr.strip()}")
    print("refused: " + p.stderr.strip())
    models()
    if FAILURES:
        print(f"{len(FAILURES)} failures")
        return 1
    print("quantized formats: every check passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
