#!/usr/bin/env python3
"""ml_dtypes' float32 -> float8_e4m3fn and float8_e5m2 casts on a fixed sample,
the reference teo's fp8 rounding kernels are compared with
(tests/kernels/fp8_rounding_test.cpp, Fp8Rounding.AgreesWithMlDtypesOnTheCommittedSample).

The sample: 16384 float32 bit patterns, half of them uniform over all 2^32
patterns and half at the hard places: exact ties of both formats in their
normal and subnormal ranges, the overflow thresholds (448 .. 480 for E4M3,
57344 .. 65536 for E5M2), float32 subnormals, zeros, infinities and NaNs.
ml_dtypes' casts round to nearest even and do not saturate: E4M3 overflows to
NaN, E5M2 to inf.

Usage (with the project's virtual environment, where ml_dtypes is installed):
  .venv/bin/python tests/interop/fp8_sample.py --out FILE
  .venv/bin/python tests/interop/fp8_sample.py --check FILE
--check recomputes the sample with the installed ml_dtypes and exits 1 unless
FILE holds the same bytes (NaN against NaN counts as equal).
"""

import argparse
import json
import struct
import sys

import ml_dtypes
import numpy as np

N = 16384


def ties(rng, k, lo_exp, hi_exp, m):
    """k float32 values exactly half way between two fp8 values with m
    mantissa bits, with binary exponents in [lo_exp, hi_exp)."""
    e = rng.randint(lo_exp, hi_exp, size=k)
    mant = rng.randint(0, 1 << m, size=k)
    # (2^m + mant + 1/2) * 2^(e - m)
    v = np.ldexp((2.0 ** m + mant + 0.5), e - m).astype(np.float32)
    return v.view(np.uint32)


def sample():
    rng = np.random.RandomState(20261128)
    uniform = rng.randint(0, 2**32, size=N // 2, dtype=np.uint64).astype(np.uint32)
    k = N // 16
    sign = lambda n: (rng.randint(0, 2, size=n).astype(np.uint32) << 31)  # noqa: E731
    f32 = lambda a: np.asarray(a, dtype=np.float32).view(np.uint32)  # noqa: E731
    hard = [
        ties(rng, k, -6, 9, 3) | sign(k),                      # E4M3 normal ties
        ties(rng, k, -14, 16, 2) | sign(k),                    # E5M2 normal ties
        f32(np.ldexp(rng.randint(0, 16, size=k) + 0.5, -9)) | sign(k),   # E4M3 subnormal ties
        f32(np.ldexp(rng.randint(0, 8, size=k) + 0.5, -16)) | sign(k),   # E5M2 subnormal ties
        f32(rng.uniform(440, 490, size=k)) | sign(k),          # E4M3's top and past it
        f32(rng.uniform(57000, 66000, size=k)) | sign(k),      # E5M2's top and past it
        rng.randint(0x33000000, 0x3C900000, size=k).astype(np.uint32) | sign(k),  # tiny
        np.concatenate([
            rng.randint(0x7F800001, 0x80000000, size=k - 12).astype(np.uint32)
            | sign(k - 12),
            np.array([0x7F800000, 0xFF800000, 0, 0x80000000, 0x7F7FFFFF, 0xFF7FFFFF,
                      0x43E80000, 0x43E80001, 0x47700000, 0x476FFFFF, 1, 0x80000001],
                     dtype=np.uint32)]),
    ]
    bits = np.concatenate([uniform] + hard).astype(np.uint32)
    bits = np.concatenate([bits, rng.randint(0, 2**32, size=N - bits.size, dtype=np.uint64)
                           .astype(np.uint32)])
    x = bits.view(np.float32)
    with np.errstate(all="ignore"):
        e4m3 = x.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
        e5m2 = x.astype(ml_dtypes.float8_e5m2).view(np.uint8)
    return x, e4m3, e5m2


def st_write(path, tensors, dtypes, meta):
    header, blobs, off = {"__metadata__": meta}, [], 0
    for name, a in tensors.items():
        b = np.ascontiguousarray(a).tobytes()
        header[name] = {"dtype": dtypes[name], "shape": list(a.shape),
                        "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def st_read(path):
    with open(path, "rb") as f:
        data = f.read()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        a, b = t["data_offsets"]
        raw = data[8 + n + a:8 + n + b]
        out[name] = np.frombuffer(raw, dtype=np.float32 if t["dtype"] == "F32" else np.uint8)
    return out


def is_nan(b, fmt):
    c = b & 0x7F
    return c == 0x7F if fmt == "e4m3" else c > 0x7C


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--out")
    g.add_argument("--check")
    args = ap.parse_args(argv)
    x, e4m3, e5m2 = sample()
    if args.out:
        st_write(args.out, {"input": x, "e4m3": e4m3, "e5m2": e5m2},
                 {"input": "F32", "e4m3": "F8_E4M3", "e5m2": "F8_E5M2"},
                 {"ml_dtypes": ml_dtypes.__version__})
        print("wrote %d values to %s (ml_dtypes %s)" % (x.size, args.out, ml_dtypes.__version__))
        return 0
    stored = st_read(args.check)
    if not np.array_equal(stored["input"].view(np.uint32), x.view(np.uint32)):
        print("the sample's inputs differ from the ones this script draws")
        return 1
    bad = 0
    for name, want in (("e4m3", e4m3), ("e5m2", e5m2)):
        got = stored[name]
        same = (got == want) | (is_nan(got, name) & is_nan(want, name))
        bad += int((~same).sum())
        print("%s: %d of %d agree with ml_dtypes %s" % (name, int(same.sum()), same.size,
                                                       ml_dtypes.__version__))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
