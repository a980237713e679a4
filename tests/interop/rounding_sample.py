#!/usr/bin/python3
"""PyTorch's float32 -> bfloat16 and float16 conversions on a fixed sample,
the reference teo's rounding kernels are compared with
(tests/kernels/rounding_test.cpp, Rounding.AgreesWithPyTorchOnTheCommittedSample).

The sample: 16384 float32 bit patterns, half of them uniform over all 2^32
patterns and half chosen at the hard places: exact ties of both formats,
fp16's subnormal range and its overflow threshold (65504 .. 65520), float32
subnormals, zeros, infinities and NaNs.

Usage:
  /usr/bin/python3 tests/interop/rounding_sample.py --out FILE
  /usr/bin/python3 tests/interop/rounding_sample.py --check FILE
--check recomputes the sample with the installed torch and exits 1 unless
FILE holds the same bits (NaN against NaN counts as equal).
"""

import argparse
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_backend as tb  # noqa: E402

N = 16384


def sample():
    rng = np.random.RandomState(20261126)
    uniform = rng.randint(0, 2**32, size=N // 2, dtype=np.uint64).astype(np.uint32)
    k = N // 16
    sign = lambda n: (rng.randint(0, 2, size=n).astype(np.uint32) << 31)  # noqa: E731
    hard = [
        # bf16 ties: the dropped 16 bits are exactly half an ulp
        (rng.randint(0, 2**16, size=k).astype(np.uint32) << 16) | 0x8000,
        # fp16 ties in the normal range (2^-14 .. 65504): 13 dropped bits
        (rng.randint(0x38800000 >> 13, 0x477FE000 >> 13, size=k)
         .astype(np.uint32) << 13) | 0x1000 | sign(k),
        # fp16's subnormal range, |x| < 2^-14, including its ties
        rng.randint(0x33000000, 0x38800000, size=k).astype(np.uint32) | sign(k),
        (rng.randint(1, 1024, size=k).astype(np.uint32) * 2 + 1)
        .astype(np.float32).view(np.uint32) - (25 << 23),  # odd multiples of 2^-25
        # around fp16's largest value and its overflow threshold
        rng.randint(0x477F0000, 0x47810000, size=k).astype(np.uint32) | sign(k),
        # float32 subnormals and tiny normals
        rng.randint(0, 0x01000000, size=k).astype(np.uint32) | sign(k),
        # NaNs (quiet and signalling), infinities, zeros, float32's extremes
        rng.randint(0x7F800001, 0x80000000, size=k - 8).astype(np.uint32)
        | sign(k - 8),
        np.array([0x7F800000, 0xFF800000, 0, 0x80000000, 0x7F7FFFFF,
                  0xFF7FFFFF, 0x477FF000, 0x477FEFFF], dtype=np.uint32),
    ]
    bits = np.concatenate([uniform] + hard).astype(np.uint32)
    rest = N - bits.size
    bits = np.concatenate([bits, rng.randint(0, 2**32, size=rest, dtype=np.uint64)
                           .astype(np.uint32)])
    x = bits.view(np.float32)
    t = torch.from_numpy(x.copy())
    bf16 = t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    fp16 = t.to(torch.float16).view(torch.int16).numpy().view(np.uint16)
    return x, bf16, fp16


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--out")
    g.add_argument("--check")
    args = ap.parse_args(argv)
    x, bf16, fp16 = sample()
    if args.out:
        tb.st_write(args.out, {"input": x, "bf16": bf16, "fp16": fp16},
                    {"torch": torch.__version__},
                    st_dtypes={"bf16": "BF16", "fp16": "F16"})
        print("wrote %d values to %s (torch %s)" % (x.size, args.out,
                                                   torch.__version__))
        return 0
    tensors, _ = tb.st_read(args.check)
    bad = 0
    for name, want in (("bf16", bf16), ("fp16", fp16)):
        got = np.asarray(tensors[name]).view(np.uint16)
        exp = 0x7F80 if name == "bf16" else 0x7C00
        nan = lambda h: ((h & exp) == exp) & ((h & (0x7FFF ^ exp)) != 0)  # noqa: E731,E501
        same = (got == want) | (nan(got) & nan(want))
        bad += int((~same).sum())
        print("%s: %d of %d agree with torch %s" % (name, int(same.sum()),
                                                   same.size, torch.__version__))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
