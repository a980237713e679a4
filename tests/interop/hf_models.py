"""Hugging Face transformers' BERT and RoBERTa, as they ship, against teo's goldens.

For each case, `teo golden export --names hf-bert` (or hf-roberta) writes the golden's parameters
and config.json; transformers loads them with `BertForSequenceClassification.from_pretrained` (or
Roberta's), runs the golden's batch (token types, padding mask, labels; RoBERTa's position ids
are teo's, position_offset + s) and backpropagates its loss. The candidate holds the hidden
states (act.embedding_norm and act.input are hidden_states[0], the layers' outputs the others),
the pooler output (RoBERTa's classification head's dense layer), the logits, the loss and every
parameter gradient under the checkpoint's own names, which `teo golden check --names` reads.
Then:
  - float64 against a float64 golden, float32 against it (--precision fp32) and against a float32
    golden, and bfloat16 within its budget, all pass;
  - mutants fail at their tensor: the token types ignored (act.embedding_norm), the pooler without
    its tanh (act.pooler), RoBERTa's positions from 0 (act.embedding_norm), the pad token's row
    given a gradient (grad.embedding.weight).
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
    from transformers import BertForSequenceClassification, RobertaForSequenceClassification
    from safetensors.torch import save_file
except ImportError as e:  # pragma: no cover - the environment decides
    print("transformers is not installed (%s): scripts/setup.sh --test installs it" % e)
    sys.exit(1 if os.environ.get("CI") == "true" else 77)

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_backend import st_read  # noqa: E402

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}


def family(case):
    return "hf-roberta" if case.startswith("roberta") else "hf-bert"


def export(teo, golden, out, names):
    os.makedirs(out, exist_ok=True)
    subprocess.run([teo, "golden", "export", "--names", names, "--golden", golden, "--out",
                    os.path.join(out, "model.safetensors"), "--hf-config",
                    os.path.join(out, "config.json"), "--force"], check=True,
                   stdout=subprocess.DEVNULL)


def candidate(golden_path, model_dir, dtype, names, mutant=None):
    """The candidate's tensors (name -> torch tensor) of the family's ForSequenceClassification."""
    tensors, meta = st_read(golden_path)
    roberta = names == "hf-roberta"
    cls = RobertaForSequenceClassification if roberta else BertForSequenceClassification
    model = cls.from_pretrained(model_dir, torch_dtype=DTYPES[dtype])
    model.train()  # the goldens have no dropout: train mode only keeps autograd as teo runs it
    # BERT's pooler, or RoBERTa's classification head's first layer: dense, then tanh
    dense = model.classifier.dense if roberta else model.bert.pooler.dense
    tanh = torch.tanh
    if mutant == "pad_row_gets_gradient":
        model.roberta.embeddings.word_embeddings.padding_idx = None
    if mutant == "pooler_without_tanh":
        tanh = torch.nn.Identity()
        if roberta:
            raise ValueError("pooler_without_tanh is a BERT mutant")
        model.bert.pooler.activation = tanh
    tokens = torch.from_numpy(tensors["input.tokens"])
    lengths = tensors["input.lengths"]
    B, S = tokens.shape
    mask = torch.from_numpy((np.arange(S)[None, :] < lengths[:, None]).astype(np.int64))
    types = torch.from_numpy(tensors["input.token_types"])
    if mutant == "token_types_ignored":
        types = torch.zeros_like(types)
    kw = {}
    if roberta:
        # teo's positions, position_offset + s (HF would count them from the tokens that are not
        # its pad token, which a right-padded batch of random tokens does not mark)
        offset = json.loads(meta["config"])["position_offset"]
        start = 0 if mutant == "roberta_positions_from_0" else offset
        kw["position_ids"] = (start + torch.arange(S))[None].expand(B, S)
    out = model(input_ids=tokens, attention_mask=mask, token_type_ids=types,
                labels=torch.from_numpy(tensors["input.labels"]), output_hidden_states=True, **kw)
    out.loss.backward()
    c = {"act.embedding_norm": out.hidden_states[0], "act.input": out.hidden_states[0]}
    for i, h in enumerate(out.hidden_states[1:]):
        c["act.layers.%d.output" % i] = h
    # the pooler's output, recomputed from the first token (the model returns only logits)
    pooled = out.hidden_states[-1][:, 0]
    c["act.pooled"] = pooled
    c["act.pooler"] = tanh(dense(pooled))
    c["act.logits"] = out.logits
    c["act.loss"] = out.loss
    for name, p in model.named_parameters():
        c["grad." + name] = p.grad
    return c


def write(c, path):
    save_file({n: t.detach().clone().contiguous() for n, t in c.items()}, path)


def check(teo, golden, cand, work, names, precision=None):
    report = os.path.join(work, "report.json")
    cmd = [teo, "golden", "check", "--no-progress", "--names", names, "--golden", golden,
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
    ("roberta_f64", "float64", None, None, None),
    ("roberta_f64", "float32", "fp32", None, None),
    ("roberta_f32", "float32", None, None, None),
    ("roberta_f64", "float64", None, "roberta_positions_from_0", "embedding_norm"),
    # its batch holds the pad token once among the real tokens
    ("roberta_f64", "float64", None, "pad_row_gets_gradient", "grad.embedding.weight"),
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
        names = family(case)
        export(args.teo, golden, os.path.join(work, "model"), names)
        cand = os.path.join(work, case + ".safetensors")
        write(candidate(golden, os.path.join(work, "model"), dtype, names, mutant), cand)
        code, first, checked, text = check(args.teo, golden, cand, work, names, precision)
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
