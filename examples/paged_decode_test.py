"""A paged-decode kernel in PyTorch, checked against teo's attention_kvcache op cases.

One step of a serving engine (decode, or a chunk of prefill), written the way serving code does it:

1. The KV cache is a pool of pages, k_pages and v_pages (num_pages, page_size, Hkv, D). Sequence
   b owns the pages block_table[b, 0], block_table[b, 1], ...: its token t sits at
   pages[block_table[b, t // page_size], t % page_size]. The table's entries past what a
   sequence uses mean nothing.
2. Append: new token i of sequence b (k_new[b, :, i], v_new[b, :, i]) is written to token slot
   cache_lengths[b] + i, through a slot mapping (the row of the page pool, flattened to tokens).
3. Attend: gather each sequence's pages through its block table (k_pages[block_table[b]]
   reshaped to tokens), keep its cache_lengths[b] + Sq tokens, give each K/V head to its
   H / Hkv query heads (GQA: query head h reads K/V head h // (H / Hkv)), and let query i, at
   position cache_lengths[b] + i, see the keys j <= cache_lengths[b] + i (bottom-right causal).
   The log-sum-exp of each query's scaled scores is output.lse, what a split-KV kernel merges
   its parts with (teo.ops.attention_merge).
4. The candidate (the updated pages, lse and context) is written with teo.golden.save and judged
   with teo.testing.assert_matches_golden: on the CPU in the case's own dtype (float64, float32,
   or bfloat16 for the bf16 case, judged against teo's error budget); with CUDA also on the GPU,
   in float32 (a float64 case judged with precision="fp32") or bfloat16.

The cases: the paged attention_kvcache cases of golden/ops whose variants this kernel has (GQA,
MQA, MLA head sizes). The others are skipped, and the run says which and why.

--mutant plants a bug: the new keys and values written one slot late (cache_lengths[b] + i + 1).
Every case must then fail, and the check (the same as `teo golden check`'s) names output.k_pages
as the first divergence: the cache is written before anything reads it.

Run:  PYTHONPATH=build/python /usr/bin/python3 examples/paged_decode_test.py [--mutant] [--out DIR]
  or  PYTHONPATH=build/python /usr/bin/python3 -m pytest -s examples/paged_decode_test.py
Exit status: 0 when everything went as expected (every case passes; with --mutant, every case
fails at output.k_pages), 1 otherwise.
"""

import argparse
import math
import os
import tempfile

import torch

import teo
import teo.testing

HERE = os.path.dirname(os.path.abspath(__file__))
OPS = os.path.normpath(os.path.join(HERE, "..", "golden", "ops"))


# ---- the kernel under test ----------------------------------------------------------------------

def paged_decode(q, k_new, v_new, cache_lengths, k_pages, v_pages, block_table, scale,
                 slot_offset=0):
    """One step on a paged KV cache. q (B, H, Sq, Dh), k_new (B, Hkv, Sq, Dh), v_new
    (B, Hkv, Sq, Dv), cache_lengths (B), k_pages (num_pages, page_size, Hkv, Dh), v_pages
    (..., Dv), block_table (B, max_pages). Returns the updated pages (copies), lse (B, H, Sq) and
    context (B, H, Sq, Dv). slot_offset moves every append (the planted bug: 1)."""
    B, H, Sq, Dh = q.shape
    _, page_size, Hkv, _ = k_pages.shape
    Dv = v_pages.shape[-1]
    dev = q.device
    work = torch.float32 if q.dtype == torch.bfloat16 else q.dtype  # softmax and lse, as autocast
    block_table = block_table.long()
    k_pages, v_pages = k_pages.clone(), v_pages.clone()

    # 1. The append: new token i of sequence b goes to token slot cache_lengths[b] + i.
    t = cache_lengths[:, None] + torch.arange(Sq, device=dev)[None, :] + slot_offset  # (B, Sq)
    b = torch.arange(B, device=dev)[:, None].expand(B, Sq)
    inside = t < block_table.shape[1] * page_size  # a slot past the table: only a bug's; dropped
    b, t = b[inside], t[inside]
    slot = block_table[b, t // page_size] * page_size + t % page_size  # row of the flat pool
    k_pages.view(-1, Hkv, Dh)[slot] = k_new.transpose(1, 2)[inside]    # (tokens, Hkv, Dh)
    v_pages.view(-1, Hkv, Dv)[slot] = v_new.transpose(1, 2)[inside]

    # 2. The attention, one sequence at a time: each has its own number of keys.
    lse = torch.empty(B, H, Sq, dtype=work, device=dev)
    context = torch.empty(B, H, Sq, Dv, dtype=q.dtype, device=dev)
    for b in range(B):
        L = int(cache_lengths[b]) + Sq                  # the cached tokens and the new ones
        pages = block_table[b, :(L + page_size - 1) // page_size]
        K = k_pages[pages].reshape(-1, Hkv, Dh)[:L].transpose(0, 1)   # (Hkv, L, Dh)
        V = v_pages[pages].reshape(-1, Hkv, Dv)[:L].transpose(0, 1)   # (Hkv, L, Dv)
        K = K.repeat_interleave(H // Hkv, dim=0)        # (H, L, Dh): head h reads h // (H / Hkv)
        V = V.repeat_interleave(H // Hkv, dim=0)
        scores = (q[b] @ K.transpose(1, 2)).to(work) * scale         # (H, Sq, L)
        position = int(cache_lengths[b]) + torch.arange(Sq, device=dev)  # of each query
        visible = torch.arange(L, device=dev)[None, :] <= position[:, None]  # bottom-right
        scores = scores.masked_fill(~visible, -math.inf)
        lse[b] = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - lse[b][..., None])
        context[b] = probs.to(q.dtype) @ V
    return k_pages, v_pages, lse, context


# ---- the cases ----------------------------------------------------------------------------------

# The spec keys of the variants this kernel does not implement (docs/semantics.md section 14).
UNSUPPORTED = ("positional", "sliding_window", "attn_logit_softcap", "attn_sinks",
               "position_offset")


def why_not(spec):
    """Why this kernel cannot run an attention_kvcache case, or None when it can."""
    if spec.get("layout") != "paged":
        return "contiguous cache (this kernel is paged)"
    if spec.get("cache_format"):
        return "a %s cache (this kernel's cache is float)" % spec["cache_format"]
    used = [k for k in UNSUPPORTED if spec.get(k) not in (None, False, "none")]
    if used:
        return "variants this kernel does not implement: " + ", ".join(used)
    if not spec.get("causal", True):
        return "not causal"
    if spec.get("precision") not in (None, "bf16"):
        return "precision %s (this kernel runs float64, float32 and bfloat16)" % spec["precision"]
    return None


def cases():
    """([(case, spec)] of the attention_kvcache cases this kernel runs, [(case, why not)] of the
    others)."""
    run, skipped = [], []
    for f in sorted(os.listdir(OPS)):
        if f.startswith("kvcache_") and f.endswith(".safetensors"):
            name, spec = f[:-len(".safetensors")], teo.golden.load(os.path.join(OPS, f)).spec
            reason = why_not(spec)
            if reason:
                skipped.append((name, reason))
            else:
                run.append((name, spec))
    return run, skipped


def runs(spec):
    """(device, dtype, precision of the check) for a case: on the CPU its own dtype; with CUDA
    also float32 or bfloat16 on the GPU."""
    if spec.get("precision") == "bf16":
        on_cpu = gpu = (torch.bfloat16, "bf16")
    elif spec["dtype"] == "float64":
        on_cpu, gpu = (torch.float64, None), (torch.float32, "fp32")
    else:
        on_cpu = gpu = (torch.float32, None)
    out = [("cpu",) + on_cpu]
    if torch.cuda.is_available():
        out.append(("cuda",) + gpu)
    return out


def candidate_file(name, device, dtype, out_dir, slot_offset=0):
    """Runs the kernel on one case's inputs and writes its candidate (the updated pages, lse and
    context) under out_dir. Returns the file's path."""
    golden = teo.golden.load(os.path.join(OPS, name + ".safetensors"))
    t = {n: torch.from_numpy(a).to(device) for n, a in golden.tensors.items()
         if n.startswith("input.")}
    q, k_new, v_new, k_pages, v_pages = (t["input." + n].to(dtype) for n in
                                         ("q", "k_new", "v_new", "k_pages", "v_pages"))
    k_pages, v_pages, lse, context = paged_decode(
        q, k_new, v_new, t["input.cache_lengths"], k_pages, v_pages, t["input.block_table"],
        golden.spec["scale"], slot_offset)
    candidate = {"output.k_pages": k_pages, "output.v_pages": v_pages, "output.context": context}
    if golden.spec["lse"]:
        candidate["output.lse"] = lse
    file = os.path.join(out_dir, "%s-%s" % (device, str(dtype)[len("torch."):]),
                        name + ".safetensors")
    teo.golden.save(file, candidate, force=True)  # torch tensors on any device, bf16 as BF16
    return file


def run_all(out_dir, mutant=False):
    """Checks the kernel on every case it runs and every device. Without mutant each candidate
    must pass (assert_matches_golden raises otherwise); with it each must fail, first at
    output.k_pages. Returns the number of candidates checked."""
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = False  # float32 products in float32, not tf32
    names, skipped = cases()
    assert names, "no paged attention_kvcache case to run in " + OPS
    for name, reason in skipped:
        print("skipped %-36s %s" % (name, reason))
    checked, worst = 0, (-1.0, "")
    for name, spec in names:
        golden = os.path.join(OPS, name + ".safetensors")
        for device, dtype, precision in runs(spec):
            file = candidate_file(name, device, dtype, out_dir, slot_offset=1 if mutant else 0)
            what = "%-36s %-4s %-8s" % (name, device, str(dtype)[len("torch."):])
            checked += 1
            if mutant:
                report = teo.golden.check(golden, file, precision=precision)
                print("%s %s, first divergence: %s" % (
                    what, "passes (the bug went unseen)" if report.passed else "FAILS as planted",
                    report.first_divergence))
                assert not report.passed and report.first_divergence == "output.k_pages", \
                    "the mutant should fail first at output.k_pages:\n%s" % report
                continue
            # require_all: every output of the case is in the candidate and passes (a vacuous
            # bf16 budget would fail too)
            report = teo.testing.assert_matches_golden(golden, file, precision=precision,
                                                       require_all=True)
            ratio, tensor = max((r.ratio, r.name) for r in report.tensors)
            print("%s PASS, worst %.2g of its bound (%s)" % (what, ratio, tensor))
            worst = max(worst, (ratio, "%s, %s %s" % (tensor, name, device)))
    if mutant:
        print("the mutant fails first at output.k_pages on all %d candidates" % checked)
    else:
        print("%d cases, %d candidates checked, all pass; worst fraction of a bound %.2g (%s)"
              % (len(names), checked, *worst))
    print("the same check from the command line: build/teo golden check --golden %s "
          "--candidate %s" % (os.path.relpath(golden), file))
    return checked


# ---- under pytest -------------------------------------------------------------------------------

def test_paged_decode_passes_the_paged_cases(tmp_path):
    run_all(str(tmp_path))


def test_a_key_appended_one_slot_late_fails_at_output_k_pages(tmp_path):
    run_all(str(tmp_path), mutant=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mutant", action="store_true",
                        help="plant the bug (new keys one slot late): every case must fail at "
                             "output.k_pages")
    parser.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "teo-paged-decode"),
                        help="where the candidates are written (default: %(default)s)")
    args = parser.parse_args()
    # anything unexpected raises AssertionError: exit status 1
    run_all(os.path.join(args.out, "mutant" if args.mutant else "candidate"), args.mutant)
