"""An encoder_decoder's bugs fail `teo golden check` where they live.

Each mutant of torch_backend.py that breaks the cross-attention runs on an encoder_decoder golden
case; the check must exit 1 with the expected first divergence. The unmutated candidate must
pass. Usage: python3 seq2seq_mutants.py --teo TEO --golden GOLDEN_FILE --work DIR
"""

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_backend as tb  # noqa: E402

# mutant -> the first tensor that must fail
EXPECTED = {
    None: None,
    # keys over the decoder's T rows instead of the source's S: a shape the golden does not have
    "cross_attn_keys_from_decoder": "decoder.layers.0.cross_attn.k",
    # padded source keys become visible: a score that must be -inf is finite
    "memory_padding_ignored": "decoder.layers.0.cross_attn.scores",
}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--teo", required=True)
    ap.add_argument("--golden", required=True)
    ap.add_argument("--work", required=True)
    args = ap.parse_args(argv)
    failures = 0
    for mutant, expected in EXPECTED.items():
        out = os.path.join(args.work, mutant or "none")
        os.makedirs(out, exist_ok=True)
        tb.process(args.golden, out, check=False, variant=tb.Variant(mutant=mutant))
        report = os.path.join(out, "report.json")
        r = subprocess.run([args.teo, "golden", "check", "--golden", args.golden, "--candidate",
                            os.path.join(out, os.path.basename(args.golden)), "--json", report],
                           capture_output=True, text=True)
        with open(report) as f:
            first = json.load(f)["cases"][0]["first_divergence"] or None
        ok = (r.returncode == 0 and first is None) if expected is None else \
            (r.returncode == 1 and first == expected)
        failures += not ok
        print("%-30s exit %d, first divergence %-36s %s"
              % (mutant or "(none)", r.returncode, first, "ok" if ok else
                 "FAIL: expected %s" % (expected or "a pass")))
    print("%d failure(s)" % failures)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
