#!/usr/bin/python3
"""PyTorch's CPU encoder on teo's bench presets, timed the way `teo bench` times teo.

Usage: /usr/bin/python3 bench/pytorch_bench.py --preset bert-base --dtype float32 --threads 2
Needs Debian's python3-torch. Prints one JSON line with the keys `teo bench --json` prints
(backend "pytorch"), so the two can be compared in one run, and `openblas_core`: the OpenBLAS
kernels PyTorch's products ran on (OPENBLAS_CORETYPE chooses them). The model is the same as teo's:
token embedding + sinusoidal positions, post-norm nn.TransformerEncoder (batch_first, gelu,
dropout 0) in train mode, mean pooling over real tokens, a linear head and cross-entropy.
"""
import argparse
import ctypes
import json
import math
import statistics
import time

import torch

PRESETS = {
    "bert-base": dict(d_model=768, heads=12, d_ff=3072, seq=128, batch=8, layers=2),
    "small": dict(d_model=256, heads=8, d_ff=1024, seq=64, batch=32, layers=4),
}


def openblas_core():
    """The kernel set OpenBLAS chose ("SkylakeX", "Cooperlake", "Prescott"...), or "-" when the
    BLAS PyTorch loaded is not OpenBLAS. Set OPENBLAS_CORETYPE to choose it."""
    for name in ("libblas.so.3", "libopenblas.so.0"):
        try:
            get = ctypes.CDLL(name).openblas_get_corename
        except (OSError, AttributeError):
            continue
        get.restype = ctypes.c_char_p
        return get().decode()
    return "-"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="small", choices=PRESETS)
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    a = ap.parse_args()
    p = PRESETS[a.preset]
    torch.set_num_threads(a.threads)
    dtype = torch.float32 if a.dtype == "float32" else torch.float64
    torch.manual_seed(0)
    B, S, D, F, L = p["batch"], p["seq"], p["d_model"], p["d_ff"], p["layers"]
    layer = torch.nn.TransformerEncoderLayer(D, p["heads"], F, dropout=0.0, activation="gelu",
                                             batch_first=True, norm_first=False)
    model = torch.nn.ModuleDict(dict(
        emb=torch.nn.Embedding(30522, D),
        enc=torch.nn.TransformerEncoder(layer, L, enable_nested_tensor=False),
        head=torch.nn.Linear(D, 2))).to(dtype).train()
    pos = torch.arange(S, dtype=torch.float64)[:, None]
    i2 = torch.arange(0, D, 2, dtype=torch.float64)
    pe = torch.zeros(S, D, dtype=torch.float64)
    pe[:, 0::2] = torch.sin(pos / 10000 ** (i2 / D))
    pe[:, 1::2] = torch.cos(pos / 10000 ** (i2[: D // 2] / D))
    pe = pe.to(dtype)
    tokens = torch.randint(0, 30522, (B, S))
    labels = torch.randint(0, 2, (B,))
    pad = torch.zeros(B, S, dtype=torch.bool)
    loss_fn = torch.nn.CrossEntropyLoss()
    fwd, fwd_bwd = [], []
    for rep in range(a.warmup + a.repeats):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        h = model["enc"](model["emb"](tokens) + pe, src_key_padding_mask=pad)
        loss = loss_fn(model["head"](h.mean(dim=1)), labels)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        if rep >= a.warmup:
            fwd.append((t1 - t0) * 1e3)
            fwd_bwd.append((t2 - t0) * 1e3)
    flops = L * (8 * B * S * D * D + 4 * B * S * S * D + 4 * B * S * D * F)
    f, fb = statistics.median(fwd), statistics.median(fwd_bwd)
    print(json.dumps(dict(preset=a.preset, dtype=a.dtype, threads=a.threads, backend="pytorch",
                          isa="torch-" + torch.__version__, fwd_ms=f, fwd_bwd_ms=fb,
                          gflops_fwd=flops / (f * 1e6), gflops_fwd_bwd=3 * flops / (fb * 1e6),
                          repeats=a.repeats, openblas_core=openblas_core())))


if __name__ == "__main__":
    main()
