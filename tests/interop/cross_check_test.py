"""torch_backend.cross_check (and cross_check_seq2seq, for an encoder_decoder case) must fail on
a mismatch, not warn.

Runs one golden case through the PyTorch backend, checks that its layer outputs
pass the comparison with nn.TransformerEncoderLayer, then moves one output
element by 1e-3 of its scale and requires Mismatch. Exit 0 when both hold.
Usage: python3 cross_check_test.py GOLDEN_FILE
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_backend as tb  # noqa: E402


def main_seq2seq(cfg, acts, extra, name):
    """An encoder_decoder: its decoder's top against nn.Transformer's, then moved by 1e-3."""
    if not tb.cross_check_seq2seq(cfg, acts, extra, name):
        print("FAIL: %s is not a case nn.Transformer can compute" % name)
        return 1
    layers = cfg["decoder_layers"] if cfg["decoder_layers"] is not None else cfg["num_layers"]
    top = "decoder.final_norm" if cfg["norm_first"] else "decoder.layers.%d.output" % (layers - 1)
    bumped = dict(acts)
    out = acts[top].detach().clone()
    out[0, 0, 0] += 1e-3 * max(1.0, float(out.abs().max()))
    bumped[top] = out
    try:
        tb.cross_check_seq2seq(cfg, bumped, extra, name)
    except tb.Mismatch as e:
        print("ok: a moved decoder output fails the cross-check with nn.Transformer: %s" % e)
        print("1 passed, 0 failed")
        return 0
    print("FAIL: a decoder output moved by 1e-3 passed the cross-check")
    print("0 passed, 1 failed")
    return 1


def main(path):
    cfg, case, tensors, _ = tb.load_case(path)
    acts, _, _, extra = tb.run_case(cfg, case, tensors)
    name = os.path.basename(path)
    if cfg["architecture"] == "encoder_decoder":
        return main_seq2seq(cfg, acts, extra, name)
    checked = [k for k in acts if k.startswith("layers.") and k.endswith(".output")]
    if not checked:
        print("FAIL: %s has no layer outputs to compare" % name)
        return 1
    tb.cross_check(cfg, acts, extra, name)  # must pass as computed
    last = "layers.%d.output" % (cfg["num_layers"] - 1)
    bumped = dict(acts)
    out = acts[last].detach().clone()
    out[0, 0, 0] += 1e-3 * max(1.0, float(out.abs().max()))
    bumped[last] = out
    try:
        tb.cross_check(cfg, bumped, extra, name)
    except tb.Mismatch as e:
        print("ok: a moved output fails the cross-check: %s" % e)
        print("1 passed, 0 failed")
        return 0
    print("FAIL: a layer output moved by 1e-3 passed the cross-check")
    print("0 passed, 1 failed")
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
