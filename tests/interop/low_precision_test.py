#!/usr/bin/python3
"""Low-precision interop test: PyTorch candidates computed in bfloat16,
float16 or tf32, judged by `teo golden check --precision`.

Usage:
  /usr/bin/python3 tests/interop/low_precision_test.py \\
      --teo TEO_BINARY --golden GOLDEN_DIR --work WORK_DIR
  /usr/bin/python3 tests/interop/low_precision_test.py --self-test \\
      --golden GOLDEN_DIR --work WORK_DIR

The test (with --teo), using tests/interop/torch_backend.py:
  a) every golden case that torch can run in bfloat16 gets a bf16
     candidate, which must pass `--precision bf16 --require-all`; the worst
     error as a fraction of the budget ("ratio") is printed;
  b) each mutant in MUTANT_STAGES, on a golden case it applies to, must
     fail (exit 1) with the expected first divergence;
  c) the sub-noise mutants (SUB_NOISE) are run and printed, whatever the
     verdict: they document what bf16 cannot see;
  a) again with the layer outputs from nn.TransformerEncoderLayer in bf16,
     on every case whose config the module can express;
  also one float16 case (skipped, with the reason, where torch has no CPU
  float16 kernels) and a few tf32 cases with `--precision tf32`, which must
  pass.

--self-test checks the PyTorch side alone, without teo: the BF16 bytes
decode to the values torch computed, the bf16 and tf32 candidates are close
to the golden, each mutant first changes the tensor expected of it, and the
tf32 rounding agrees with an independent one.

Exit status: 0 when everything required holds, 1 otherwise, 2 on bad
usage.
"""

import argparse
import json
import math
import os
import struct
import subprocess
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")  # a shared machine
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch_backend as tb  # noqa: E402

# Mutant -> the stage `teo golden check` must name as the first divergence
# (the tensor name without "act."). Every tensor before it in the golden's
# order is computed exactly as without the bug (--self-test checks this bit
# for bit), and at this stage the bug's error is far beyond bf16's own
# (80 to 350 times on the corpus, or a finite score where -inf belongs).
MUTANT_STAGES = {
    # q, k and v are untouched; the scale multiplies their product.
    "scores_1_over_dh": "layers.0.scores",
    # The split itself is wrong, and q is the first of q, k, v (in pre-norm
    # layers.0.norm1 comes before it, but is untouched).
    "heads_interleaved": "layers.0.q",
    # Query i now sees key i+1: a score that must be -inf becomes finite,
    # which the checker's rule for non-finite entries always catches.
    "causal_off_by_one": "layers.0.scores",
    # act.embedding, the only tensor before it, is untouched.
    "pe_base_1000": "positional",
    # Everything before pooling is untouched (final_norm included).
    "mean_pool_padding": "pooled",
}

# Mutants whose effect is expected to stay below bfloat16's noise.
# ln_eps_1e-6 would first change the first LayerNorm (layers.0.norm1), but
# torch 1.13's bfloat16 LayerNorm on the CPU does not change a single bit
# for any eps below about 1e-4 (next to a variance near 1). gelu_tanh_grad
# first changes grad.layers.{L-1}.ffn.fc1.weight, by about bf16's own error.
SUB_NOISE = ("ln_eps_1e-6", "gelu_tanh_grad")

PRECISION_NAMES = {"bfloat16": "bf16", "float16": "fp16", "tf32": "tf32"}


# ---------------------------------------------------------------------------
# Reading candidates, independently of torch_backend's writer
# ---------------------------------------------------------------------------

FLOAT_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2"}


def bf16_to_float32(bits):
    """Decodes bfloat16 bit patterns (uint16): they are the upper half of
    the float32 with the same value."""
    return (bits.astype("<u4") << 16).view("<f4")


def read_candidate(path):
    """name -> (safetensors dtype, shape, float64 values) for every tensor
    of a candidate file (float dtypes, and a routing's I32 ids)."""
    with open(path, "rb") as f:
        blob = f.read()
    (size,) = struct.unpack_from("<Q", blob)
    header = json.loads(blob[8:8 + size].decode("utf-8"))
    header.pop("__metadata__", None)
    data = blob[8 + size:]
    out = {}
    for name, entry in header.items():
        begin, end = entry["data_offsets"]
        raw = data[begin:end]
        if entry["dtype"] == "BF16":
            values = bf16_to_float32(np.frombuffer(raw, dtype="<u2"))
        elif entry["dtype"] == "I32":  # a routing: the experts chosen
            values = np.frombuffer(raw, dtype="<i4")
        else:
            values = np.frombuffer(raw, dtype=FLOAT_DTYPES[entry["dtype"]])
        out[name] = (entry["dtype"], tuple(entry["shape"]),
                     values.astype(np.float64).reshape(entry["shape"]))
    return out


# ---------------------------------------------------------------------------
# Golden cases
# ---------------------------------------------------------------------------

class Case:
    """One golden file: its config and tensors, as torch_backend reads
    them."""

    def __init__(self, path):
        self.path = path
        self.name = os.path.basename(path)[:-len(".safetensors")]
        self.cfg, self.case, self.tensors, _ = tb.load_case(path)
        self.lengths = [int(n) for n in self.tensors["input.lengths"]]

    def reference(self, name):
        """The float64 values a candidate's tensor is judged against:
        ref64.<name> for a float32 golden, the tensor itself for float64."""
        return self.tensors.get("ref64." + name, self.tensors.get(name))

    def checked_names(self):
        """The golden's act.* and grad.* names, in the checker's order."""
        return [n for n in self.tensors if n.startswith(("act.", "grad."))]

    def oddity(self):
        """How unusual the case is: config keys away from the defaults,
        plus an empty batch or a length-0 sequence."""
        keys = ("norm_first", "activation", "layer_norm_eps", "positional",
                "embed_scale", "pooling", "dropout", "label_smoothing",
                "causal", "input")
        unusual = sum(self.cfg[k] != tb.CONFIG_DEFAULTS[k] for k in keys)
        return unusual + (not self.lengths) + (0 in self.lengths)


def load_cases(golden_dir):
    """The cases a reduced precision can judge: an encoder_decoder's golden has no budget (its
    decoder layer emulates none; docs/semantics.md, section 17.5)."""
    cases = []
    for path in tb.golden_files(golden_dir):
        cfg, _, _, _ = tb.load_case(path)
        if cfg["architecture"] != "encoder_decoder":
            cases.append(Case(path))
    return cases


def pick_case(cases, variant, wanted=lambda case: True):
    """The plainest case that `variant` can run and `wanted` accepts (ties
    by name), so that a bug is the only unusual thing about it; or None."""
    fits = [c for c in cases if wanted(c)
            and tb.variant_problem(variant, c.cfg, c.tensors) is None]
    return min(fits, key=lambda c: (c.oddity(), c.name), default=None)


def write_candidate(case, out_dir, variant):
    """Writes the candidate; returns its path. Raises tb.Unsupported."""
    os.makedirs(out_dir, exist_ok=True)
    tb.process(case.path, out_dir, False, variant)
    return os.path.join(out_dir, case.name + ".safetensors")


# ---------------------------------------------------------------------------
# Error measures (for --self-test; the real judge is teo)
# ---------------------------------------------------------------------------

def normwise_error(case, name, values):
    """max|c - ref| / scale over the entries where the reference is finite,
    or inf when the non-finite entries differ. scale = max|ref|, and for a
    bias gradient the larger of its own and its weight gradient's (as the
    checker does: grad.*.attn.k.bias is 0 in exact arithmetic)."""
    ref = case.reference(name)
    finite = np.isfinite(ref)
    same_nonfinite = np.array_equal(ref[~finite], values[~finite],
                                    equal_nan=True)
    if not same_nonfinite or not np.isfinite(values[finite]).all():
        return math.inf
    if not finite.any():
        return 0.0
    scale = float(np.abs(ref[finite]).max())
    if name.startswith("grad.") and name.endswith(".bias"):
        weight = case.reference(name[:-len("bias")] + "weight")
        if weight is not None and weight.size:
            scale = max(scale, float(np.abs(weight).max()))
    err = float(np.abs(values[finite] - ref[finite]).max())
    return err / scale if scale > 0 else (0.0 if err == 0 else math.inf)


def max_pool_flips(case, cand):
    """How many (sequence, column) pairs max pooling takes from another
    position in the candidate than in the reference. Past such a flip the
    gradients differ by O(1), which no rounding bound covers."""
    cfg, layers = case.cfg, case.cfg["num_layers"]
    if cfg["pooling"] != "max":
        return 0
    if cfg["norm_first"]:
        top = "act.final_norm"
    else:
        top = "act.layers.%d.output" % (layers - 1) if layers else "act.input"
    mine, ref = cand[top][2], case.reference(top)
    return sum(int((mine[b, :n].argmax(0) != ref[b, :n].argmax(0)).sum())
               for b, n in enumerate(case.lengths) if n > 0)


def routing_flips(case, cand):
    """How many (position, slot) experts the candidate chose otherwise than
    the golden, over every MoE layer. Past such a flip the expert outputs
    and every later tensor differ by O(1): teo reports the position
    ambiguous, or a wrong expert, and no rounding bound covers them."""
    return sum(int((cand[n][2] != case.tensors[n]).sum())
               for n in case.tensors if n.endswith(".moe.topk_ids")
               and n.startswith("act.") and n in cand)


def first_difference(names, a, b):
    """The first name whose values differ bit for bit between two decoded
    candidates (NaN equal to NaN), or None."""
    for name in names:
        x, y = a[name][2], b[name][2]
        if not np.array_equal(x, y, equal_nan=True):
            return name
    return None


def stage(name):
    """A tensor name as the checker names a stage: act. dropped."""
    return name[len("act."):] if name.startswith("act.") else name


# ---------------------------------------------------------------------------
# The test against teo
# ---------------------------------------------------------------------------

def run_check(teo, case, candidate, precision, report_path):
    """Runs `teo golden check`; returns (exit code, case report or None,
    first stderr line)."""
    os.makedirs(os.path.dirname(report_path), exist_ok=True)
    if os.path.exists(report_path):
        os.remove(report_path)
    argv = [teo, "golden", "check", "--golden", case.path,
            "--candidate", candidate, "--precision", precision,
            "--require-all", "--json", report_path]
    proc = subprocess.run(argv, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
    with open(report_path[:-len(".json")] + ".txt", "w") as f:
        f.write(proc.stdout + proc.stderr)
    report = None
    if os.path.exists(report_path):
        with open(report_path) as f:
            report = json.load(f)["cases"][0]
    message = (proc.stderr.strip().splitlines() or [""])[0]
    return proc.returncode, report, message


def worst_ratio(report):
    """(largest ratio, its tensor) over the checked tensors; a failure with
    no finite ratio (a NaN or inf where the golden has none) counts as
    inf."""
    worst = (-math.inf, None)
    for t in report["tensors"]:
        if t["status"] == "vacuous":
            continue  # not judged: its ratio means nothing
        ratio = t.get("ratio")
        if ratio is None:
            if t["status"] != "fail":
                continue
            ratio = math.inf
        worst = max(worst, (ratio, t["name"]))
    return worst


def ratio_text(worst):
    ratio, name = worst
    return "-" if name is None else "%.3g (%s)" % (ratio, name)


class Table:
    """The summary: one row per check."""

    def __init__(self):
        self.rows = []

    def add(self, check, case, result, detail, ok):
        """ok: True (passed), False (failed) or None (informational)."""
        verdict = {True: "ok", False: "FAIL", None: "info"}[ok]
        self.rows.append((check, case, result, detail, verdict))
        print("%-4s  %s  %s: %s  %s" % (verdict, check, case, result, detail))

    def print(self):
        heads = ("check", "case", "result", "worst ratio (tensor) / note",
                 "verdict")
        widths = [max(len(str(r[i])) for r in self.rows + [heads])
                  for i in range(5)]
        print()
        for row in [heads] + self.rows:
            print("  ".join(str(v).ljust(w) for v, w in zip(row, widths))
                  .rstrip())

    def failed(self):
        return sum(r[4] == "FAIL" for r in self.rows)

    def passed(self):
        return sum(r[4] == "ok" for r in self.rows)


def replayed_check(teo, case, work, variant):
    """The case regenerated with `replay_routing` (its own routing given as
    input.layers.{i}.moe.topk_ids), a candidate computed with that routing,
    judged by --precision bf16: run_check's (exit code, report, message)."""
    _, meta = tb.st_read(case.path)
    config = json.loads(meta["config"])
    config["case"] = dict(json.loads(meta["case"]), replay_routing=True)
    out = os.path.join(work, "replay", "golden")
    os.makedirs(out, exist_ok=True)
    spec = os.path.join(out, case.name + ".json")
    with open(spec, "w") as f:
        json.dump(config, f)
    golden = os.path.join(out, case.name + ".safetensors")
    subprocess.run([teo, "golden", "generate", "--config", spec, "--out",
                    golden, "--force"], check=True,
                   stdout=subprocess.DEVNULL)
    replayed = Case(golden)
    cand = write_candidate(replayed, os.path.join(work, "replay", "bf16"),
                           variant)
    return run_check(teo, replayed, cand, "bf16",
                     os.path.join(work, "reports", "replay", case.name
                                  + ".json"))


def check_all_bf16(teo, cases, work, table, nn_layer=False):
    """a) every case torch can run in bf16 passes --precision bf16: as the
    functional graph, or (nn_layer) with the layer outputs from
    nn.TransformerEncoderLayer on every case whose config it can express."""
    variant = tb.Variant(dtype="bfloat16", transformer_layer=nn_layer)
    subdir = "bf16-nn-layer" if nn_layer else "bf16"
    label = "a) bf16 nn.TransformerEncoderLayer" if nn_layer else "a) bf16 candidates"
    worst, skipped, failed, run = (-math.inf, None), [], [], 0
    for case in cases:
        try:
            cand = write_candidate(case, os.path.join(work, subdir), variant)
        except tb.Unsupported as e:
            print("skip  %s %s: %s" % (subdir, case.name, e))
            skipped.append(case.name)
            continue
        run += 1
        code, report, message = run_check(
            teo, case, cand, "bf16",
            os.path.join(work, "reports", subdir, case.name + ".json"))
        if (code == 1 and report is not None and report["failed"] == 0
                and report["vacuous"] > 0):
            # teo itself says bf16 cannot judge this case: its budget is
            # vacuous (a max-pooling argmax within bf16's noise of a tie).
            # The case is not bf16-capable; no tensor failed.
            vacuous = next(t for t in report["tensors"]
                           if t["status"] == "vacuous")
            print("skip  bf16 %s: %d tensor(s) with a vacuous budget: %s"
                  % (case.name, report["vacuous"], vacuous["message"]))
            skipped.append(case.name)
            case_worst = worst_ratio(report)
            if case_worst[1] is not None:
                worst = max(worst, (case_worst[0], "%s in %s"
                                    % (case_worst[1], case.name)))
            continue
        if (code == 1 and report is not None and report["failed"] == 0
                and report["vacuous"] == 0 and report["ambiguous"] > 0):
            # torch's bf16 router chose otherwise where the margin is within
            # bf16's tolerance: teo says ambiguous, by position. Router
            # replay (the golden's routing given) must then judge the rest,
            # and pass.
            where = ", ".join("%s token %d (margin %.2g <= %.2g)"
                              % (t["layer"], t["token"], t["margin"],
                                 t["tolerance"])
                              for t in report["ambiguous_tokens"])
            code, report, message = replayed_check(teo, case, work, variant)
            print("%s  bf16 %s: ambiguous at %s; with router replay: exit %d"
                  % ("ok  " if code == 0 else "FAIL", case.name, where, code))
        if code != 0 or report is None:
            failed.append(case.name)
            first = report["first_divergence"] if report else "(no report)"
            print("FAIL  bf16 %s: exit %d, first divergence %s %s"
                  % (case.name, code, first, message))
            continue
        case_worst = worst_ratio(report)
        if case_worst[1] is not None:
            worst = max(worst, (case_worst[0],
                                "%s in %s" % (case_worst[1], case.name)))
    summary = "%d run, %d failed, %d skipped" % (run, len(failed),
                                                 len(skipped))
    table.add(label, "all cases", summary, ratio_text(worst),
              run > 0 and not failed)
    print("worst fraction of the bf16 budget over all passing cases (%s): %s"
          % (subdir, ratio_text(worst)))


def check_mutant(teo, cases, work, table, mutant, expected):
    """b) a mutant must fail with the expected first divergence; c) with
    expected None, only report what happened."""
    variant = tb.Variant(dtype="bfloat16", mutant=mutant)
    label = ("b) " if expected else "c) ") + mutant
    case = pick_case(cases, variant)
    if case is None:
        table.add(label, "-", "no golden case it applies to", "",
                  False if expected else None)
        return
    cand = write_candidate(case, os.path.join(work, "mutants", mutant),
                           variant)
    code, report, message = run_check(
        teo, case, cand, "bf16",
        os.path.join(work, "reports", "mutants", mutant + ".json"))
    if report is None:
        table.add(label, case.name, "exit %d, no report" % code, message,
                  False if expected else None)
        return
    first = report["first_divergence"]
    result = "exit %d, first divergence %s" % (code, first or "none")
    detail = ratio_text(worst_ratio(report))
    if expected:
        detail = "expected exit 1 at %s" % expected
        table.add(label, case.name, result, detail,
                  code == 1 and first == expected)
    else:
        verdict = "passed: invisible in bf16" if code == 0 else "caught"
        table.add(label, case.name, result, "%s; %s" % (detail, verdict),
                  None)


def check_precision(teo, cases, work, table, label, variant, wanted,
                    required=True):
    """A candidate made as `variant` on the plainest case `wanted` accepts
    must pass `--precision` (float16: skipped where torch cannot run it)."""
    case = pick_case(cases, variant, wanted)
    if case is None:
        table.add(label, "-", "no golden case fits", "", False)
        return
    precision = PRECISION_NAMES["tf32" if variant.tf32 else variant.dtype]
    subdir = precision + ("-nn-layer" if variant.transformer_layer else "")
    try:
        cand = write_candidate(case, os.path.join(work, subdir), variant)
    except tb.Unsupported as e:
        table.add(label, case.name, "skipped", str(e), None)
        return
    code, report, message = run_check(
        teo, case, cand, precision,
        os.path.join(work, "reports", subdir, case.name + ".json"))
    if report is None:
        table.add(label, case.name, "exit %d, no report" % code, message,
                  False if required else None)
        return
    table.add(label, case.name, "exit %d, first divergence %s"
              % (code, report["first_divergence"] or "none"),
              ratio_text(worst_ratio(report)),
              code == 0 if required else None)


def run_test(teo, golden_dir, work):
    cases = load_cases(golden_dir)
    table = Table()
    check_all_bf16(teo, cases, work, table)
    check_all_bf16(teo, cases, work, table, nn_layer=True)
    for mutant, expected in MUTANT_STAGES.items():
        check_mutant(teo, cases, work, table, mutant, expected)
    for mutant in SUB_NOISE:
        check_mutant(teo, cases, work, table, mutant, None)
    check_precision(teo, cases, work, table, "fp16",
                    tb.Variant(dtype="float16"), lambda c: True)
    # tf32 on a few shapes: post-norm, pre-norm, causal, dropout.
    shapes = [("post-norm", lambda c: not c.cfg["norm_first"]),
              ("pre-norm", lambda c: c.cfg["norm_first"]),
              ("causal", lambda c: c.cfg["causal"]),
              ("dropout", lambda c: c.cfg["dropout"] > 0)]
    for shape, wanted in shapes:
        check_precision(teo, cases, work, table, "tf32 %s" % shape,
                        tb.Variant(tf32=True), wanted)
    table.print()
    print("\n%d passed, %d failed" % (table.passed(), table.failed()))
    return 1 if table.failed() else 0


# ---------------------------------------------------------------------------
# --self-test: the PyTorch side alone
# ---------------------------------------------------------------------------

# Normwise error bounds for the self-test, set from measurements on the
# corpus with some margin (the self-test prints the figures). bfloat16 keeps
# 8 significant bits (unit roundoff u = 2^-8 = 3.9e-3), tf32 11 (u = 2^-11
# = 4.9e-4). Forward errors reach a few u (probs after large scores);
# backward ones are larger: torch's CPU kernels accumulate some sums over
# rows in bfloat16, where a running sum stops growing once the terms fall
# below half its ulp (LayerNorm's bias gradient over the 183 rows of
# seq_len_113 is 15% off). Torch's bfloat16 kernels differ by CPU: the
# worst forward error is 2.5e-2 with AVX-512 and 3.2e-2 (seq_len_113's
# context) on an AVX2-only AMD EPYC (family 25).
CLOSE_ENOUGH = {("bfloat16", "act."): 4e-2, ("bfloat16", "grad."): 2e-1,
                ("tf32", "act."): 5e-3, ("tf32", "grad."): 1e-2}


class Problems:
    """Collects failed self-test checks."""

    def __init__(self):
        self.items = []

    def require(self, ok, what):
        if not ok:
            self.items.append(what)
            print("FAIL  " + what)


def self_test_decoding(cases, work, problems):
    """The BF16 bytes decode to exactly what torch computed; names and
    shapes are those of the float candidate."""
    # The decoder itself, on hand-made patterns.
    bits = np.array([0x3F80, 0xC020, 0x3E20, 0xFF80, 0x0001],
                    dtype=np.uint16)
    expect = np.array([1.0, -2.5, 0.15625, -np.inf, 2.0 ** -133],
                      dtype=np.float32)
    problems.require(np.array_equal(bf16_to_float32(bits), expect),
                     "bf16 decoder on known bit patterns")

    case = pick_case(cases, tb.Variant(dtype="bfloat16"))
    bf16 = tb.Variant(dtype="bfloat16")
    decoded = read_candidate(write_candidate(
        case, os.path.join(work, "self-test", "bf16"), bf16))
    floats = read_candidate(write_candidate(
        case, os.path.join(work, "self-test", "float"), tb.AS_GOLDEN))
    acts, act_grads, param_grads, _ = tb.run_case(case.cfg, case.case,
                                                  case.tensors, bf16)
    computed = {"act." + n: t for n, t in acts.items()}
    computed.update({"grad." + n: t for n, t in param_grads.items()})
    computed.update({"grad.act." + n: t for n, t in act_grads.items()})
    mismatched = [n for n, (_, _, v) in decoded.items()
                  if not np.array_equal(
                      v, computed[n].detach().float().numpy(),
                      equal_nan=True)]
    dtypes = {d for d, _, _ in decoded.values()}
    same_layout = {n: s for n, (_, s, _) in decoded.items()} == \
        {n: s for n, (_, s, _) in floats.items()}
    print("bf16 candidate of %s: %d tensors, dtypes %s, %d differ from "
          "torch's values after decoding; names and shapes %s the float "
          "candidate's" % (case.name, len(decoded), sorted(dtypes),
                           len(mismatched),
                           "equal" if same_layout else "DIFFER from"))
    problems.require(dtypes == {"BF16"} and not mismatched and same_layout,
                     "BF16 candidate decodes to torch's values")

    # The float16 path of the writer (torch cannot run the model in float16
    # on the CPU, so this is its only check here).
    half = torch.tensor([[1.0, -2.5], [65504.0, 2.0 ** -24]],
                        dtype=torch.float16)
    path = os.path.join(work, "self-test", "f16.safetensors")
    tb.st_write(path, {"x": tb.to_numpy(half)}, {})
    dtype, _, values = read_candidate(path)["x"]
    problems.require(dtype == "F16" and np.array_equal(
        values, half.double().numpy()), "F16 written and decoded")


def self_test_closeness(cases, work, problems):
    """bf16, tf32 and bf16 nn.TransformerEncoderLayer candidates against
    the golden's float64 reference."""
    runs = [("bfloat16", tb.Variant(dtype="bfloat16")),
            ("tf32", tb.Variant(tf32=True)),
            ("bfloat16", tb.Variant(dtype="bfloat16",
                                    transformer_layer=True))]
    for key, variant in runs:
        label = key + (" nn-layer" if variant.transformer_layer else "")
        errors = {"act.": [], "grad.": []}  # (error, "case tensor")
        skipped, moe_measured = 0, 0
        for case in cases:
            try:
                cand = read_candidate(write_candidate(
                    case, os.path.join(work, "self-test", label), variant))
            except tb.Unsupported:
                skipped += 1
                continue
            names = case.checked_names()
            if variant.transformer_layer:
                names = [n for n in names if n.startswith("act.layers.")
                         and n.endswith(".output")]
            # the ids are compared exactly by teo, not measured here
            names = [n for n in names if cand[n][0] != "I32"]
            rerouted = routing_flips(case, cand)
            if rerouted:
                print("%-17s %s: %d expert(s) chosen otherwise; the case is "
                      "left out (teo judges it with router replay)"
                      % (label, case.name, rerouted))
                skipped += 1
                continue
            moe_measured += case.cfg["ffn"] == "moe"
            flips = max_pool_flips(case, cand)
            if flips:
                names = [n for n in names if n.startswith("act.")]
                print("%-17s %s: max pooling picks another position in %d "
                      "column(s); its gradients are left out"
                      % (label, case.name, flips))
            for name in names:
                kind = "act." if name.startswith("act.") else "grad."
                errors[kind].append((normwise_error(case, name,
                                                    cand[name][2]),
                                     case.name + " " + name))
        for kind in ("act.", "grad."):
            if not errors[kind]:
                continue
            ranked = sorted(errors[kind], reverse=True)
            bound = CLOSE_ENOUGH[(key, kind)]
            print("%-17s %-4s %4d tensors (%d cases skipped): median %.2e, "
                  "bound %.0e, worst %s"
                  % (label, kind[:-1], len(ranked), skipped,
                     float(np.median([e for e, _ in ranked])), bound,
                     ", ".join("%.2e %s" % r for r in ranked[:3])))
            problems.require(ranked[0][0] <= bound,
                             "%s %s close to the golden" % (label, kind))
        if not variant.transformer_layer:  # nn.TransformerEncoderLayer has no experts
            problems.require(moe_measured >= 3, "%s measures MoE cases (%d measured)"
                             % (label, moe_measured))


def self_test_mutants(cases, work, problems):
    """Each mutant first changes the tensor expected of it (all earlier
    tensors bit for bit equal to the bf16 candidate without the bug), and
    by how much compared with bf16's own error there."""
    for mutant in list(MUTANT_STAGES) + list(SUB_NOISE):
        variant = tb.Variant(dtype="bfloat16", mutant=mutant)
        case = pick_case(cases, variant)
        if case is None:
            problems.require(False, "%s applies to a golden case" % mutant)
            continue
        root = os.path.join(work, "self-test", "mutants")
        honest = read_candidate(write_candidate(
            case, os.path.join(root, "none"), tb.Variant(dtype="bfloat16")))
        buggy = read_candidate(write_candidate(
            case, os.path.join(root, mutant), variant))
        names = case.checked_names()
        first = first_difference(names, honest, buggy)
        # Signal to noise: the bug's error over bf16's own, at the first
        # changed tensor and at worst over all tensors.
        snr = {}
        for name in names:
            base = normwise_error(case, name, honest[name][2])
            moved = normwise_error(case, name, buggy[name][2])
            snr[name] = moved / base if base > 0 else (
                1.0 if moved == 0 else math.inf)
        if first is None:
            print("%-18s on %-18s changes no bit" % (mutant, case.name))
        else:
            top = max(names, key=lambda n: snr[n])
            print("%-18s on %-18s first changes %-31s (x%.3g bf16's error "
                  "there; at most x%.3g, at %s)"
                  % (mutant, case.name, first, snr[first], snr[top], top))
        if mutant in MUTANT_STAGES:
            problems.require(first is not None and stage(first) ==
                             MUTANT_STAGES[mutant],
                             "%s first changes %s" % (
                                 mutant, MUTANT_STAGES[mutant]))


def self_test_tf32(problems):
    """round_to_tf32 agrees bit for bit with rounding done another way:
    in float64, scaling the significand to 11 bits and rounding half to
    even with numpy."""
    rng = np.random.default_rng(1)
    with np.errstate(over="ignore"):  # some overflow to inf, as wanted
        x = (rng.standard_normal(200000) *
             np.exp2(rng.integers(-140, 128, 200000))).astype(np.float32)
    # Exact ties (bit 12 set, bits 0-11 clear) on both kinds of kept bit,
    # the largest floats, subnormals, zeros, infinities and NaN.
    ties = np.array([0x3F801000, 0x3F803000, 0xBF801000, 0xBF803000,
                     0x7F7FFFFF, 0x7F7FF000, 0x00001000, 0x00003000,
                     0x00000FFF, 0x80000000, 0x00000000, 0x7F800000,
                     0xFF800000], dtype=np.uint32).view(np.float32)
    x = np.concatenate([x, ties])
    mantissa, exponent = np.frexp(x.astype(np.float64))
    expect = np.ldexp(np.round(mantissa * 2048.0) / 2048.0, exponent)
    # Below float32's normal range the significand has fewer bits: tf32
    # keeps the same 10 explicit bits of the float32 subnormal spacing.
    tiny = np.abs(x) < np.float32(2.0 ** -126)
    step = 2.0 ** -136
    expect[tiny] = np.round(x[tiny].astype(np.float64) / step) * step
    with np.errstate(over="ignore"):  # the largest floats round to inf
        expect = expect.astype(np.float32)
    got = tb.round_to_tf32(torch.from_numpy(x)).numpy()
    same = np.array_equal(got.view(np.uint32), expect.view(np.uint32))
    nan = tb.round_to_tf32(torch.tensor([math.nan]))
    print("tf32 rounding: %d values (random over all exponents, ties, "
          "subnormals, limits): %s; NaN stays NaN: %s"
          % (x.size, "all equal" if same else "DIFFERENT",
             bool(torch.isnan(nan).all())))
    problems.require(same and bool(torch.isnan(nan).all()),
                     "tf32 rounding")


def self_test_fp16(cases, work):
    case = pick_case(cases, tb.Variant(dtype="float16"))
    try:
        write_candidate(case, os.path.join(work, "self-test", "fp16"),
                        tb.Variant(dtype="float16"))
        print("fp16: %s runs" % case.name)
    except tb.Unsupported as e:
        print("fp16: %s skipped: %s" % (case.name, e))


def run_self_test(golden_dir, work):
    cases = load_cases(golden_dir)
    problems = Problems()
    self_test_decoding(cases, work, problems)
    self_test_closeness(cases, work, problems)
    self_test_mutants(cases, work, problems)
    self_test_tf32(problems)
    self_test_fp16(cases, work)
    print("self-test %s" % ("failed: " + "; ".join(problems.items)
                            if problems.items else "passed"))
    return 1 if problems.items else 0


def main(argv=None):
    ap = argparse.ArgumentParser(
        description="Low-precision PyTorch candidates against "
                    "`teo golden check --precision`.")
    ap.add_argument("--teo", help="the teo executable")
    ap.add_argument("--golden", required=True, help="the golden directory")
    ap.add_argument("--work", required=True,
                    help="a directory for candidates and reports")
    ap.add_argument("--self-test", action="store_true",
                    help="check the PyTorch side alone, without teo")
    args = ap.parse_args(argv)
    if args.self_test == (args.teo is not None):
        ap.error("give either --teo TEO_BINARY or --self-test")
    if not os.path.isdir(args.golden):
        ap.error("--golden %s is not a directory" % args.golden)
    if args.teo is not None and not os.access(args.teo, os.X_OK):
        ap.error("--teo %s is not an executable" % args.teo)
    torch.set_num_threads(1)
    try:
        if args.self_test:
            return run_self_test(args.golden, args.work)
        return run_test(args.teo, args.golden, args.work)
    except tb.BadInput as e:
        print("error: %s" % e, file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
