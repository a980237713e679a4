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
Then the other direction, goldens from a checkpoint of one's own: for each family transformers
builds the model from a small config with random weights (its own initialisation, then
LayerNorm's weights and every bias moved away from 1 and 0, the other weights scaled to std 0.2)
and saves it with `save_pretrained` as F32 and as F64 safetensors (the same values).
`teo golden generate --weights model.safetensors --names hf-X --hf-config config.json` makes the
golden of a case (float64 of the F64 checkpoint, float32 of the F32 one, float64 of the F32 one);
`teo golden export` writes it again, and:
  - the round trip holds: the exported checkpoint has the saved one's tensors, no more and none
    missing but those the map ignores, each of the same dtype, shape and bytes (of the float64
    golden of the F32 checkpoint: F64, the F32 values widened exactly, and that golden is the
    F64 checkpoint's, tensor for tensor); its config.json reads in transformers as the saved one
    but for the dtype, label2id (left out) and classifier_dropout (None written as 0.0);
  - the saved model, loaded in the case's dtype, passes the golden, and one mutant per family
    fails at its tensor (the token types ignored, RoBERTa's positions from 0, ViT's [CLS]
    appended).
Usage: python hf_models.py --teo TEO --golden GOLDEN_DIR --work DIR
Without transformers it exits 77 (a skip), or 1 when CI=true.
"""

import argparse
import fnmatch
import json
import os
import struct
import subprocess
import sys

try:
    import torch
    import transformers
    from transformers import (AutoConfig, BertConfig, BertForSequenceClassification, RobertaConfig,
                              RobertaForSequenceClassification, ViTConfig,
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


# Goldens from a checkpoint of the user's own: transformers builds each family's model from a
# small config with random weights and saves it, teo makes the golden of that checkpoint, and the
# same model passes it.
OWN_CONFIGS = {
    "hf-bert": lambda: BertForSequenceClassification(BertConfig(
        vocab_size=40, hidden_size=12, num_hidden_layers=2, num_attention_heads=3,
        intermediate_size=24, max_position_embeddings=16, type_vocab_size=2, num_labels=3,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)),
    # positions from pad_token_id + 1 = 2: 2 + seq_len 9 rows of the 16
    "hf-roberta": lambda: RobertaForSequenceClassification(RobertaConfig(
        vocab_size=40, hidden_size=12, num_hidden_layers=2, num_attention_heads=3,
        intermediate_size=24, max_position_embeddings=16, type_vocab_size=1, num_labels=3,
        pad_token_id=1, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)),
    # 3 × 3 patches of 2 × 2 pixels
    "hf-vit": lambda: ViTForImageClassification(ViTConfig(
        image_size=6, patch_size=2, num_channels=3, hidden_size=12, num_hidden_layers=2,
        num_attention_heads=3, intermediate_size=24, num_labels=3, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0)),
}
OWN_SEEDS = {"hf-bert": 1, "hf-roberta": 2, "hf-vit": 3}
# the name maps' source, for their "ignore" globs
MAPS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "src", "golden",
                    "names")


def own_model(names):
    """The family's model of random weights: transformers' own initialisation, then LayerNorm's
    weights moved away from 1, every bias away from 0 and the other weights scaled from HF's
    std 0.02 to 0.2 (attention that is not uniform, a tanh that is not linear), in float32."""
    torch.manual_seed(OWN_SEEDS[names])
    model = OWN_CONFIGS[names]()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.add_(0.2 * torch.randn_like(p))
            elif "layernorm" in name.lower():
                p.add_(0.2 * torch.randn_like(p))
            else:  # the pad token's row of zeros stays zeros
                p.mul_(10)
    return model


def own_case(names, dtype):
    case = {"batch": 3, "dtype": dtype, "seed": 7}
    if names != "hf-vit":  # ViT's sequence follows from the image and patch sizes
        case.update(seq_len=9, lengths=[9, 5, 2])
    return {"case": case}


def st_raw(path):
    """A safetensors file's tensors as name -> (dtype, shape, bytes), as stored."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    return {name: (h["dtype"], tuple(h["shape"]), data[h["data_offsets"][0]:h["data_offsets"][1]])
            for name, h in header.items() if name != "__metadata__"}


def round_trip(saved, exported, names, widened=False):
    """Compares the checkpoint the model saved with teo's export of its golden: the problems
    found (a list of strings) and the number of tensors compared. With widened (an F32 checkpoint
    exported from a float64 golden) each tensor must be its F64 widening, value for value."""
    with open(os.path.join(MAPS, names + ".json")) as f:
        ignore = json.load(f)["ignore"]
    a, b = st_raw(saved), st_raw(exported)
    problems = []
    missing = [n for n in sorted(set(a) - set(b))
               if not any(fnmatch.fnmatchcase(n, g) for g in ignore)]
    extra = sorted(set(b) - set(a))
    if missing:
        problems.append("not exported: " + ", ".join(missing))
    if extra:
        problems.append("exported, not saved: " + ", ".join(extra))
    for n in sorted(set(a) & set(b)):
        (da, sa, ba), (db, sb, bb) = a[n], b[n]
        if sa != sb:
            problems.append("%s: shape %s saved, %s exported" % (n, sa, sb))
        elif widened and (da, db) == ("F32", "F64"):
            wide = np.frombuffer(ba, "<f4").astype("<f8").tobytes()
            if wide != bb:
                problems.append("%s: F64 export is not the F32 checkpoint widened" % n)
        elif da != db:
            problems.append("%s: dtype %s saved, %s exported" % (n, da, db))
        elif ba != bb:
            problems.append("%s: bytes differ" % n)
    return problems, len(set(a) & set(b))


# config.json's keys that an export may write otherwise: the dtype and version it was saved with,
# label2id (not written: transformers then leaves it None), a classifier_dropout of None (0.0,
# the same: no dropout)
CONFIG_MAY_DIFFER = {"_name_or_path", "torch_dtype", "transformers_version", "label2id"}


def config_differs(saved_dir, exported_dir):
    """The keys whose values differ between the saved and exported config.json, as transformers
    reads them (its defaults filled in)."""
    a = AutoConfig.from_pretrained(saved_dir).to_dict()
    b = AutoConfig.from_pretrained(exported_dir).to_dict()
    return sorted(k for k in set(a) | set(b) if k not in CONFIG_MAY_DIFFER and a.get(k) != b.get(k)
                  and not (k == "classifier_dropout" and a.get(k) is None and b.get(k) == 0.0))


def same_goldens(p, q):
    """The tensors of two goldens that differ (by dtype, shape or bytes) or that one lacks."""
    a, b = st_raw(p), st_raw(q)
    return sorted(n for n in set(a) | set(b) if a.get(n) != b.get(n))


# (family, the checkpoint's dtype, the case's dtype, the mutant, the first tensor that must fail)
OWN_RUNS = [
    ("hf-bert", "float64", "float64", None, None),
    ("hf-bert", "float32", "float32", None, None),
    ("hf-bert", "float32", "float64", None, None),
    ("hf-bert", "float64", "float64", "token_types_ignored", "embedding_norm"),
    ("hf-roberta", "float64", "float64", None, None),
    ("hf-roberta", "float32", "float32", None, None),
    ("hf-roberta", "float32", "float64", None, None),
    ("hf-roberta", "float64", "float64", "roberta_positions_from_0", "embedding_norm"),
    ("hf-vit", "float64", "float64", None, None),
    ("hf-vit", "float32", "float32", None, None),
    ("hf-vit", "float32", "float64", None, None),
    ("hf-vit", "float64", "float64", "cls_appended", "embedding"),
]


def own_checkpoints(names, work):
    """Saves the family's model as F32 and F64 checkpoints (the same values); their directories."""
    model = own_model(names)
    dirs = {}
    for dtype in ("float32", "float64"):
        dirs[dtype] = os.path.join(work, "own_" + names, "checkpoint_" + dtype)
        model.to(DTYPES[dtype]).save_pretrained(dirs[dtype], safe_serialization=True)
    return dirs


def own_run(teo, names, ckpt_dtype, dtype, mutant, dirs, work):
    """Makes the golden of the family's saved checkpoint, exports it again and checks the saved
    model against it: (problems of the import and the round trip, the check's result)."""
    ckpt = dirs[ckpt_dtype]
    os.makedirs(work, exist_ok=True)
    case = os.path.join(work, "case.json")
    with open(case, "w") as f:
        json.dump(own_case(names, dtype), f)
    golden = os.path.join(work, "golden.safetensors")
    r = subprocess.run([teo, "golden", "generate", "--no-progress", "--config", case, "--out",
                        golden, "--force", "--weights", os.path.join(ckpt, "model.safetensors"),
                        "--names", names, "--hf-config", os.path.join(ckpt, "config.json")],
                       capture_output=True, text=True)
    if r.returncode != 0:
        return ["teo golden generate refused the checkpoint: " + r.stderr.strip()], None, None
    export(teo, golden, os.path.join(work, "export"), names)
    problems, compared = round_trip(os.path.join(ckpt, "model.safetensors"),
                                    os.path.join(work, "export", "model.safetensors"), names,
                                    widened=ckpt_dtype != dtype)
    differ = config_differs(ckpt, os.path.join(work, "export"))
    if differ:
        problems.append("config.json differs at " + ", ".join(differ))
    if ckpt_dtype != dtype:
        # the same case of the same values, read from the checkpoint of the case's dtype
        same = os.path.join(work, "golden_of_%s.safetensors" % dtype)
        subprocess.run([teo, "golden", "generate", "--no-progress", "--config", case, "--out",
                        same, "--force", "--weights",
                        os.path.join(dirs[dtype], "model.safetensors"), "--names", names,
                        "--hf-config", os.path.join(dirs[dtype], "config.json")], check=True,
                       stdout=subprocess.DEVNULL)
        differ = same_goldens(golden, same)
        if differ:
            problems.append("the golden of the %s checkpoint differs from the %s one's at %s"
                            % (ckpt_dtype, dtype, ", ".join(differ[:5])))
    cand = os.path.join(work, "candidate.safetensors")
    # the model as saved, loaded in the case's dtype (the F32 checkpoint widened for float64)
    write(candidate(golden, ckpt, dtype, names, mutant), cand)
    return problems, compared, check(teo, golden, cand, work, names)


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
    checkpoints = {}
    for names, ckpt_dtype, dtype, mutant, expected in OWN_RUNS:
        if names not in checkpoints:
            checkpoints[names] = own_checkpoints(names, args.work)
        label = "own_" + names[3:]
        work = os.path.join(args.work, "own_%s_%s_%s_%s" % (names, ckpt_dtype, dtype,
                                                            mutant or "none"))
        problems, compared, result = own_run(args.teo, names, ckpt_dtype, dtype, mutant,
                                             checkpoints[names], work)
        code, first, checked, text = result or (None, None, 0, "")
        ok = (not problems and compared >= 40 and checked >= 30
              and ((code == 0 and first is None) if expected is None
                   else (code == 1 and first == expected)))
        failures += not ok
        trip = ("%d tensors %s" % (compared, "widened exactly" if ckpt_dtype != dtype
                                   else "byte-identical")) if compared else "no round trip"
        print("%-10s %-9s %-5s %-21s exit %s, %2d checked, first divergence %-15s %s"
              % (label, dtype, {"float64": "F64", "float32": "F32"}[ckpt_dtype],
                 mutant or "(correct)", code, checked, first,
                 ("ok, " + trip) if ok else "FAIL: expected " + (expected or "a pass") + ", "
                 + trip))
        for problem in problems:
            print("  " + problem)
        if not ok and text:
            print(text)
    print("%d failure(s)" % failures)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
