"""Hugging Face transformers' BERT, RoBERTa and ViT, as they ship, against teo's goldens.

For each case, `teo golden export --names hf-bert` (or hf-roberta, hf-vit) writes the golden's
parameters and config.json; transformers loads them with `from_pretrained` of
BertForSequenceClassification (or Roberta's, or ViTForImageClassification), runs the golden's
batch and backpropagates its loss. BERT and RoBERTa take the tokens, token types, padding mask
and labels (RoBERTa's position ids are teo's, position_offset + s); their candidate holds the
hidden states (act.embedding_norm and act.input are hidden_states[0], the layers' outputs the
others), the pooler output (RoBERTa's classification head's dense layer), the logits and the
loss. ViT takes the golden's pixels and labels; its candidate holds act.embedding ([CLS] and the
patch projections, before the positions are added), act.positional, the hidden states (act.input
is hidden_states[0], the layers' outputs, before the final LayerNorm, the others),
act.final_norm, act.pooled (its row 0), the logits and the loss. Every candidate also holds
every parameter gradient under the checkpoint's own names, which `teo golden check --names` reads.
Then:
  - float64 against a float64 golden, float32 against it (--precision fp32) and against a float32
    golden, and bfloat16 within its budget, all pass;
  - mutants fail at their tensor: the token types ignored (act.embedding_norm), the pooler without
    its tanh (act.pooler), RoBERTa's positions from 0 (act.embedding_norm), the pad token's row
    given a gradient (grad.embedding.weight), ViT's patches flattened (P, P, C) against a weight
    laid out (C, P, P) (act.embedding), its [CLS] appended after the patches instead of
    prepended (act.embedding).
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
    from transformers import (BertForSequenceClassification, RobertaForSequenceClassification,
                              ViTForImageClassification)
    from safetensors.torch import save_file
except ImportError as e:  # pragma: no cover - the environment decides
    print("transformers is not installed (%s): scripts/setup.sh --test installs it" % e)
    sys.exit(1 if os.environ.get("CI") == "true" else 77)

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_backend import st_read  # noqa: E402

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}


def family(case):
    if case.startswith("roberta"):
        return "hf-roberta"
    if case.startswith("vit") or case == "bf16_vit":
        return "hf-vit"
    return "hf-bert"


def export(teo, golden, out, names):
    os.makedirs(out, exist_ok=True)
    subprocess.run([teo, "golden", "export", "--names", names, "--golden", golden, "--out",
                    os.path.join(out, "model.safetensors"), "--hf-config",
                    os.path.join(out, "config.json"), "--force"], check=True,
                   stdout=subprocess.DEVNULL)


def candidate(golden_path, model_dir, dtype, names, mutant=None):
    """The candidate's tensors (name -> torch tensor) of the family's model."""
    if names == "hf-vit":
        return vit_candidate(golden_path, model_dir, dtype, mutant)
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


def vit_candidate(golden_path, model_dir, dtype, mutant=None):
    """The candidate's tensors (name -> torch tensor) of ViTForImageClassification."""
    tensors, _ = st_read(golden_path)
    model = ViTForImageClassification.from_pretrained(model_dir, torch_dtype=DTYPES[dtype])
    model.train()  # the goldens have no dropout: train mode only keeps autograd as teo runs it
    emb = model.vit.embeddings
    if mutant == "patches_flattened_ppc":
        # A port that flattens each patch (P, P, C), channels fastest, but multiplies it by the
        # checkpoint's weight matrix (D, C·P·P) as stored: the (C, P, P) row of weight d is read
        # as (P, P, C). As a Conv2d's weight, that is w.reshape(D, P, P, C).permute(0, 3, 1, 2).
        w = emb.patch_embeddings.projection.weight
        D, C, P, _ = w.shape
        with torch.no_grad():
            w.copy_(w.detach().clone().reshape(D, P, P, C).permute(0, 3, 1, 2))
    # act.embedding is [CLS] and the patch projections before the positions are added, which the
    # model does not return: a hook takes the patch projections the model computed and prepends
    # its cls_token as ViTEmbeddings.forward does
    seen = {}

    def patches_hook(module, args, patches):
        cls = emb.cls_token.expand(patches.shape[0], -1, -1)
        seen["embedding"] = torch.cat((cls, patches), dim=1)

    emb.patch_embeddings.register_forward_hook(patches_hook)
    model.vit.layernorm.register_forward_hook(lambda m, a, y: seen.__setitem__("final_norm", y))
    if mutant == "cls_appended":
        # ViTEmbeddings.forward of a port that appends [CLS] after the patches (its act.embedding
        # replaces the hook's)
        def forward(pixel_values, **kw):
            patches = emb.patch_embeddings(pixel_values)
            cls = emb.cls_token.expand(patches.shape[0], -1, -1)
            seen["embedding"] = torch.cat((patches, cls), dim=1)
            return emb.dropout(seen["embedding"] + emb.position_embeddings)

        emb.forward = forward
    pixels = torch.from_numpy(tensors["input.pixels"]).to(DTYPES[dtype])
    # num_labels > 1 and integer labels: the model's loss is CrossEntropyLoss, the batch's mean
    out = model(pixel_values=pixels, labels=torch.from_numpy(tensors["input.labels"]),
                output_hidden_states=True)
    out.loss.backward()
    c = {"act.embedding": seen["embedding"], "act.positional": emb.position_embeddings[0],
         "act.input": out.hidden_states[0]}
    # the layers' outputs; the final LayerNorm is applied after the last of them
    for i, h in enumerate(out.hidden_states[1:]):
        c["act.layers.%d.output" % i] = h
    c["act.final_norm"] = seen["final_norm"]
    c["act.pooled"] = seen["final_norm"][:, 0]
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
    ("vit_f64", "float64", None, None, None),
    ("vit_f64", "float32", "fp32", None, None),
    ("vit_f32", "float32", None, None, None),
    ("bf16_vit", "bfloat16", None, None, None),
    ("vit_f64", "float64", None, "patches_flattened_ppc", "embedding"),
    ("vit_f64", "float64", None, "cls_appended", "embedding"),
    ("vit_f32", "float32", None, "cls_appended", "embedding"),
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
        # every tensor the candidate writes: BERT's 1 + 1 + L + pooled, pooler, logits, loss,
        # ViT's embedding, positional, input, L, final_norm, pooled, logits, loss; + grads
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
