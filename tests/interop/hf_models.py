"""Hugging Face transformers' BertModel, as it ships, against teo's BERT goldens.

For each case, `teo golden export --names hf-bert` writes the golden's parameters and config.json;
transformers loads them with `BertForSequenceClassification.from_pretrained`, runs the golden's
batch (token types, padding mask, labels) and backpropagates its loss. The candidate holds the
hidden states (act.embedding_norm and act.input are hidden_states[0], the layers' outputs the
others), the pooler output, the logits, the loss and every parameter gradient under the
checkpoint's own names, which `teo golden check --names hf-bert` reads. Then:
  - float64 against a float64 golden, float32 against it (--precision fp32) and against a float32
    golden, and bfloat16 within its budget, all pass;
  - mutants fail at their tensor: the token types ignored (act.embedding_norm), the pooler without
    its tanh (act.pooler).
Usage: python hf_models.py --teo TEO --golden GOLDEN_DIR --work DIR
Without transformers it exits 77 (a skip), or 1 when CI=true.
"""

import argparse
import json
import os
import subprocess
import sys

try:
    import torch
    import transformers
    from transformers import BertForSequenceClassification
    from safetensors.torch import save_file
except ImportError as e:  # pragma: no cover - the environment decides
    print("transformers is not installed (%s): scripts/setup.sh --test installs it" % e)
    sys.exit(1 if os.environ.get("CI") == "true" else 77)

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_backend import st_read  # noqa: E402

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}


def export(teo, golden, out):
    os.makedirs(out, exist_ok=True)
    subprocess.run([teo, "golden", "export", "--names", "hf-bert", "--golden", golden, "--out",
                    os.path.join(out, "model.safetensors"), "--hf-config",
                    os.path.join(out, "config.json"), "--force"], check=True,
                   stdout=subprocess.DEVNULL)


def candidate(golden_path, model_dir, dtype, mutant=None):
    """The candidate's tensors (name -> torch tensor) of BertForSequenceClassification."""
    tensors, _ = st_read(golden_path)
    model = BertForSequenceClassification.from_pretrained(model_dir, torch_dtype=DTYPES[dtype])
    model.train()  # the goldens have no dropout: train mode only keeps autograd as teo runs it
    if mutant == "pooler_without_tanh":
        model.bert.pooler.activation = torch.nn.Identity()
    tokens = torch.from_numpy(tensors["input.tokens"])
    lengths = tensors["input.lengths"]
    B, S = tokens.shape
    mask = torch.from_numpy((np.arange(S)[None, :] < lengths[:, None]).astype(np.int64))
    types = torch.from_numpy(tensors["input.token_types"])
    if mutant == "token_types_ignored":
        types = torch.zeros_like(types)
    out = model(input_ids=tokens, attention_mask=mask, token_type_ids=types,
                labels=torch.from_numpy(tensors["input.labels"]), output_hidden_states=True)
    out.loss.backward()
    c = {"act.embedding_norm": out.hidden_states[0], "act.input": out.hidden_states[0]}
    for i, h in enumerate(out.hidden_states[1:]):
        c["act.layers.%d.output" % i] = h
    # BertModel's pooler output: recomputed from the first token (the model returns only logits)
    pooled = out.hidden_states[-1][:, 0]
    c["act.pooled"] = pooled
    c["act.pooler"] = model.bert.pooler.activation(model.bert.pooler.dense(pooled))
    c["act.logits"] = out.logits
    c["act.loss"] = out.loss
    for name, p in model.named_parameters():
        c["grad." + name] = p.grad
    return c


def write(c, path):
    save_file({n: t.detach().clone().contiguous() for n, t in c.items()}, path)


def check(teo, golden, cand, work, precision=None):
    report = os.path.join(work, "report.json")
    cmd = [teo, "golden", "check", "--no-progress", "--names", "hf-bert", "--golden", golden,
           "--candidate", cand, "--json", report]
    if precision:
        cmd += ["--precision", precision]
    r = subprocess.run(cmd, capture_output=True, text=True)
    with open(report) as f:
        case = json.load(f)["cases"][0]
    checked = case["passed"] + case["failed"]
    return r.returncode, case["first_divergence"] or None, checked, r.stdout


# (golden case, dtype of the model, --precision, the mutant, the first tensor that must fail)
RUNS = [
    ("bert_f64", "float64", None, None, None),
    ("bert_f64", "float32", "fp32", None, None),
    ("bert_f32", "float32", None, None, None),
    ("bf16_bert", "bfloat16", None, None, None),
    ("bert_f64", "float64", None, "token_types_ignored", "embedding_norm"),
    ("bert_f64", "float64", None, "pooler_without_tanh", "pooler"),
    ("bert_f32", "float32", None, "pooler_without_tanh", "pooler"),
]


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--teo", required=True)
    ap.add_argument("--golden", required=True)
    ap.add_argument("--work", required=True)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    print("transformers %s, torch %s" % (transformers.__version__, torch.__version__))
    failures = 0
    for case, dtype, precision, mutant, expected in RUNS:
        golden = os.path.join(args.golden, case + ".safetensors")
        work = os.path.join(args.work, "%s_%s_%s" % (case, dtype, mutant or "none"))
        export(args.teo, golden, os.path.join(work, "model"))
        cand = os.path.join(work, case + ".safetensors")
        write(candidate(golden, os.path.join(work, "model"), dtype, mutant), cand)
        code, first, checked, text = check(args.teo, golden, cand, work, precision)
        # every tensor the candidate writes: 1 + 1 + L + pooled, pooler, logits, loss + grads
        ok = checked >= 30 and ((code == 0 and first is None) if expected is None
                                else (code == 1 and first == expected))
        failures += not ok
        print("%-10s %-9s %-5s %-21s exit %d, %2d checked, first divergence %-15s %s"
              % (case, dtype, precision or "", mutant or "(correct)", code, checked, first,
                 "ok" if ok else "FAIL: expected " + (expected or "a pass")))
        if not ok:
            print(text)
    print("%d failure(s)" % failures)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
