#!/usr/bin/env python3
"""teo's GGUF block formats against llama.cpp's own Python package, `gguf` (gguf-py), bit for bit.

1. gguf's GGUFWriter writes a file with a tensor of random blocks of every type teo reads (Q8_0,
   Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, MXFP4, NVFP4, F32, F16, BF16), every byte drawn but
   the scales, which are drawn finite; and metadata of every value type.
2. `teo gguf inspect --json` must give back every metadata key, type and value, and every tensor's
   type and dims; `teo gguf dequantize` must give, for every tensor, the bits of
   gguf.quants.dequantize (its numpy code), or the first block and element where they differ.
3. Each type also goes the other way: `teo gguf quantize` writes it, and gguf's GGUFReader reads
   the file and dequantizes to teo's own values, bit for bit.
4. Mutants of gguf's dequantization (one field of each of several layouts wrong) must each fail at
   its own tensor and pass the others; a block with an infinite scale must be refused by name.

Usage: .venv/bin/python tests/interop/gguf_blocks.py TEO_BINARY WORK_DIR
Exits 1 on any failure.
"""

import json
import os
import sys

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q
from interop_io import FAILURES, fail, read_safetensors, run, write_safetensors

TYPES = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K",
         "MXFP4", "NVFP4"]
# Where each block holds its F16 scales (byte offsets), from ggml-common.h's block structs.
F16_SCALES = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
              "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}
ROWS, BLOCKS_PER_ROW = 3, 4


def random_blocks(rng, name):
    """(rows, row bytes) uint8 of random blocks of type `name`, every scale finite."""
    qt = Q[name]
    values, size = gguf.GGML_QUANT_SIZES[qt]
    if name in ("F32", "F16", "BF16"):
        x = rng.standard_normal((ROWS, 64)).astype(np.float32) * 3
        if name == "F32":
            return x.view(np.uint8)
        if name == "F16":
            return x.astype(np.float16).view(np.uint8)
        return (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    b = rng.integers(0, 256, size=(ROWS * BLOCKS_PER_ROW, size), dtype=np.uint8)
    for at in F16_SCALES.get(name, []):
        # finite F16 of both signs, normal and subnormal: exponent field 0..30
        h = rng.integers(0, 0x10000, size=len(b), dtype=np.uint32)
        h = np.where((h & 0x7C00) == 0x7C00, h & 0xBFFF, h).astype(np.uint16)
        b[:, at:at + 2] = h.view(np.uint8).reshape(-1, 2)
    if name == "MXFP4":
        # E8M0 0xff is NaN; 253 and 254 overflow float32 with large codes (refused, below)
        b[:, 0] = rng.integers(0, 253, size=len(b))
    if name == "NVFP4":
        b[:, 0:4] = rng.integers(0, 0x7F, size=(len(b), 4))  # unsigned E4M3 below 0x7f
    return b.reshape(ROWS, BLOCKS_PER_ROW * size)


def first_difference(want, got, name):
    """'' when the bits agree, else where they first differ: block, element, both values."""
    w = np.ascontiguousarray(want, np.float32).reshape(-1).view(np.uint32)
    g = np.ascontiguousarray(got, np.float32).reshape(-1).view(np.uint32)
    if w.shape != g.shape:
        return f"{w.size} values against {g.size}"
    bad = np.nonzero(w != g)[0]
    if bad.size == 0:
        return ""
    i = int(bad[0])
    per = gguf.GGML_QUANT_SIZES[Q[name]][0]
    return (f"{bad.size} of {w.size} values differ, first at block {i // per} element {i % per}: "
            f"gguf {w.view(np.float32)[i]!r}, teo {g.view(np.float32)[i]!r}")


def gguf_values(reader):
    return {t.name: (t.tensor_type.name, gguf.quants.dequantize(t.data, t.tensor_type))
            for t in reader.tensors}


def write_gguf(w):
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_one_tensor(path, name, blocks, qtype):
    """A file of one tensor of raw blocks, written by gguf's GGUFWriter (which checks nothing)."""
    w = gguf.GGUFWriter(path, arch="teo-interop")
    w.add_tensor(name, blocks, raw_dtype=qtype)
    write_gguf(w)


def write_source(path, rng):
    w = gguf.GGUFWriter(path, arch="teo-interop")
    w.add_uint8("test.u8", 200)
    w.add_int8("test.i8", -100)
    w.add_uint16("test.u16", 60000)
    w.add_int16("test.i16", -30000)
    w.add_uint32("test.u32", 4000000000)
    w.add_int32("test.i32", -2000000000)
    w.add_float32("test.f32", 0.1)
    w.add_uint64("test.u64", 2**63 + 5)
    w.add_int64("test.i64", -(2**62))
    w.add_float64("test.f64", 1 / 3)
    w.add_bool("test.bool", True)
    w.add_string("test.string", "naïve Größe 数")
    w.add_array("test.strings", ["a", "", "ü"])
    w.add_array("test.ints", [1, -2, 3])
    w.add_array("test.floats", [0.5, -1.25])
    for name in TYPES:
        w.add_tensor(f"t.{name.lower()}", random_blocks(rng, name), raw_dtype=Q[name])
    write_gguf(w)


def check_metadata(teo_json, reader):
    teo_meta = {m["key"]: m for m in teo_json["metadata"]}
    fields = {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    if set(teo_meta) != set(fields):
        fail(f"metadata keys differ: teo {sorted(teo_meta)}, gguf {sorted(fields)}")
    for k, f in fields.items():
        m = teo_meta.get(k)
        if m is None:
            continue
        if m["type"] != f.types[0].name:
            fail(f"metadata {k}: teo type {m['type']}, gguf {f.types[0].name}")
        want = f.contents()
        floats = {"FLOAT32": np.float32, "FLOAT64": np.float64}.get(f.types[-1].name)
        if floats:  # gguf widens FLOAT32 to a Python float; compare at the stored width
            same = np.array_equal(np.array(want, floats), np.array(m["value"], floats))
        else:
            same = want == m["value"]
        if not same:
            fail(f"metadata {k}: teo {m['value']!r}, gguf {want!r}")
    teo_tensors = {t["name"]: t for t in teo_json["tensors"]}
    for t in reader.tensors:
        mine = teo_tensors.get(t.name)
        if mine is None or mine["type"] != t.tensor_type.name or \
                mine["dims"] != [int(d) for d in t.shape]:
            fail(f"tensor {t.name}: teo {mine}, gguf {t.tensor_type.name} {list(t.shape)}")


def compare(want, teo_path, what):
    got = read_safetensors(teo_path)
    bad = []
    for name, (type_name, values) in want.items():
        diff = first_difference(values, got[name], type_name)
        if diff:
            bad.append(name)
            print(f"  {what}: {name} ({type_name}): {diff}")
    return bad


# Mutants of gguf's dequantization: each (name, type it breaks, how), the blocks altered before
# gguf decodes them, or gguf's decoding patched, so that one layout rule is wrong.
def swap_nibbles(b, lo, hi):
    b = b.copy()
    b[:, lo:hi] = (b[:, lo:hi] >> 4) | (b[:, lo:hi] << 4)
    return b


MUTANTS = {
    "mxfp4_nibbles_swapped": ("MXFP4", lambda b: swap_nibbles(b, 1, 17)),
    "nvfp4_scales_reversed": ("NVFP4", lambda b: np.concatenate([b[:, 3::-1], b[:, 4:]], 1)),
    "q5_0_high_bits_ignored": ("Q5_0", lambda b: np.concatenate(
        [b[:, :2], np.zeros_like(b[:, 2:6]), b[:, 6:]], 1)),
    "q4_k_scale_fields_off_by_one": ("Q4_K", lambda b: np.concatenate(
        [b[:, :4], np.roll(b[:, 4:16], 1, axis=1), b[:, 16:]], 1)),
    "q6_k_scale_sign_dropped": ("Q6_K", None),
    "e2m1_negative_zero_nonzero": ("MXFP4", None),
}


def mutant_values(reader, mutant):
    kind, alter = MUTANTS[mutant]
    saved_q6, saved_kv = gguf.quants.Q6_K.dequantize_blocks, gguf.quants.MXFP4.kvalues
    if mutant == "q6_k_scale_sign_dropped":
        def q6(cls, blocks):
            blocks = blocks.copy()
            s = blocks[:, 192:208]
            blocks[:, 192:208] = np.where(s >= 128, s - 128, s)
            return saved_q6.__func__(cls, blocks)
        gguf.quants.Q6_K.dequantize_blocks = classmethod(q6)
    if mutant == "e2m1_negative_zero_nonzero":
        gguf.quants.MXFP4.kvalues = (0, 1, 2, 3, 4, 6, 8, 12, -1, -1, -2, -3, -4, -6, -8, -12)
    try:
        out = {}
        for t in reader.tensors:
            data = t.data
            if t.tensor_type.name == kind and alter is not None:
                size = gguf.GGML_QUANT_SIZES[t.tensor_type][1]
                data = alter(np.ascontiguousarray(data).reshape(-1, size)).reshape(data.shape)
            out[t.name] = (t.tensor_type.name, gguf.quants.dequantize(data, t.tensor_type))
        return out
    finally:
        gguf.quants.Q6_K.dequantize_blocks = saved_q6
        gguf.quants.MXFP4.kvalues = saved_kv


def main():
    teo, work = sys.argv[1], sys.argv[2]
    os.makedirs(work, exist_ok=True)
    rng = np.random.default_rng(52)
    src = os.path.join(work, "gguf_py.gguf")
    write_source(src, rng)
    reader = gguf.GGUFReader(src)
    p = run([teo, "gguf", "inspect", "--json", src])
    if p.returncode == 0:
        check_metadata(json.loads(p.stdout), reader)
    deq = os.path.join(work, "teo_dequantized.safetensors")
    run([teo, "gguf", "dequantize", src, "--out", deq, "--force"])
    want = gguf_values(reader)
    for name in compare(want, deq, "gguf-py's file"):
        fail(f"{name}: teo's dequantization is not gguf's")
    print(f"gguf-py's file: {len(want)} tensors, teo's values are gguf's bit for bit"
          if not FAILURES else "gguf-py's file: differences above")

    # The other way: teo quantizes weights to every type, gguf reads and dequantizes.
    weights = os.path.join(work, "weights.safetensors")
    write_safetensors(weights, {"w": rng.standard_normal((3, 512)).astype(np.float32) * 0.05,
                                "norm": 1 + rng.standard_normal(512).astype(np.float32) * 0.1})
    for name in TYPES:
        out = os.path.join(work, f"teo_{name}.gguf")
        if run([teo, "gguf", "quantize", weights, "--type", name, "--out", out, "--arch", "teo",
                "--force"]).returncode != 0:
            continue
        r = gguf.GGUFReader(out)
        arch = r.fields["general.architecture"].contents()
        if arch != "teo":
            fail(f"teo's {name} file: general.architecture {arch!r}")
        types = {t.name: t.tensor_type.name for t in r.tensors}
        if types != {"w": name, "norm": "F32"}:
            fail(f"teo's {name} file holds {types}")
        back = os.path.join(work, f"teo_{name}.safetensors")
        run([teo, "gguf", "dequantize", out, "--out", back, "--force"])
        for bad in compare(gguf_values(r), back, f"teo's {name} file"):
            fail(f"teo's {name} file, {bad}: gguf reads other values than teo")
    print("teo's files: gguf reads every type and gets teo's values")

    # Mutants: each fails at its own tensor, and only there.
    for mutant, (kind, _) in MUTANTS.items():
        bad = compare(mutant_values(reader, mutant), deq, mutant)
        if bad != [f"t.{kind.lower()}"]:
            fail(f"mutant {mutant}: failed at {bad}, expected only t.{kind.lower()}")
        else:
            print(f"mutant {mutant}: fails at t.{kind.lower()} only")

    # A block with an infinite scale: gguf-py reads it, teo refuses it by tensor and block.
    inf = os.path.join(work, "inf_scale.gguf")
    b = random_blocks(rng, "Q8_0")
    b.reshape(-1, 34)[5, 0:2] = np.array([0x7C00], np.uint16).view(np.uint8)
    write_one_tensor(inf, "bad", b, Q.Q8_0)
    p = run([teo, "gguf", "inspect", inf], expect=2)
    if "tensor bad, block 5" not in p.stderr or "not finite" not in p.stderr:
        fail(f"the infinite scale was not named: {p.stderr.strip()}")
    print("an infinite F16 scale: " + p.stderr.strip())
    # An MXFP4 block whose values gguf decodes to inf (E8M0 254, code 7: 6 * 2^127).
    over = os.path.join(work, "mxfp4_overflow.gguf")
    b = np.zeros((1, 17), np.uint8)
    b[0, 0], b[0, 1] = 254, 0x07
    if np.isfinite(gguf.quants.dequantize(b, Q.MXFP4)).all():
        fail("gguf decodes E8M0 254 with code 7 as finite")
    write_one_tensor(over, "over", b, Q.MXFP4)
    p = run([teo, "gguf", "inspect", over], expect=2)
    if "tensor over, block 0" not in p.stderr or "overflows float32" not in p.stderr:
        fail(f"the overflowing MXFP4 block was not named: {p.stderr.strip()}")
    print("an MXFP4 block gguf decodes to inf: " + p.stderr.strip())
    if FAILURES:
        print(f"{len(FAILURES)} failures")
        return 1
    print("gguf interop: every check passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
