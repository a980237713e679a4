#!/usr/bin/python3
"""PyTorch backend for teo's golden checker.

Reads teo golden files (safetensors, "teo-golden/1"), rebuilds the encoder
in PyTorch from the stored config, inputs, parameters and dropout masks,
runs forward and backward with ordinary torch ops, and writes one candidate
file per golden ("teo-candidate/1") holding every act.* and grad.* tensor.
The candidates are then compared by `teo golden check`.

Usage:
  /usr/bin/python3 tests/interop/torch_backend.py --golden PATH --out DIR
      [--dtype float64|float32|bfloat16|float16 | --tf32]
      [--mutant NAME] [--transformer-layer] [--no-cross-check]
  /usr/bin/python3 tests/interop/torch_backend.py --golden PATH \
      --list-unsupported

PATH is one golden file or a directory of *.safetensors files. The model
follows docs/semantics.md; where teo deliberately differs from PyTorch
(section 12: fully masked attention rows, pooling over zero tokens, the
empty batch) this script follows teo. Exit status: 0 on success, 1 if a
case failed unexpectedly, 2 on bad input.

By default each case runs in its golden's dtype. The options make
candidates for `teo golden check --precision bf16|fp16|tf32`:
  --dtype D            the parameters (float32/float64 values in the golden)
                       are converted with torch's .to(D), everything runs in
                       D, and every act.* and grad.* tensor is written in D
                       (safetensors F64, F32, BF16 or F16);
  --tf32               float32, with every GEMM operand rounded to tf32
                       first (10 explicit mantissa bits), as tensor cores do;
  --mutant NAME        a deliberate one-line bug (see MUTANTS), so that a
                       test can check that the checker finds it;
  --transformer-layer  act.layers.{i}.output comes from a chain of
                       nn.TransformerEncoderLayer modules instead (forward
                       only; everything else is from the functional graph).
A case the chosen options cannot express (a mutant that does not apply, a
float16 kernel torch lacks on the CPU) is reported as unsupported.
"""

import argparse
import dataclasses
import fnmatch
import json
import math
import re
import os
import struct
import sys
import time
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F


class BadInput(Exception):
    """A missing path or a malformed golden file (exit status 2)."""


class Unsupported(Exception):
    """A case this backend cannot express."""


# ---------------------------------------------------------------------------
# safetensors (the public format: u64 LE header size, JSON header, data)
# ---------------------------------------------------------------------------

ST_DTYPES = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),  # numpy has no bfloat16: the raw bit patterns
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"), "U8": np.dtype("u1"), "BOOL": np.dtype("?"),
    # numpy has no fp8: the bytes (a quantized weight's scales, fp8 operands)
    "F8_E4M3": np.dtype("u1"), "F8_E5M2": np.dtype("u1"),
}
ST_NAMES = {np.dtype("<f8"): "F64", np.dtype("<f4"): "F32",
            np.dtype("<f2"): "F16", np.dtype("<i8"): "I64",
            np.dtype("<i4"): "I32", np.dtype("u1"): "U8"}


def st_read(path):
    """Returns (tensors: name -> numpy array, metadata: dict)."""
    try:
        with open(path, "rb") as f:
            blob = f.read()
    except OSError as e:
        raise BadInput("cannot read %s: %s" % (path, e.strerror))
    if len(blob) < 8:
        raise BadInput("%s: too short for a safetensors file" % path)
    (hlen,) = struct.unpack("<Q", blob[:8])
    if hlen > len(blob) - 8:
        raise BadInput("%s: header length %d exceeds the file" % (path, hlen))
    try:
        header = json.loads(blob[8:8 + hlen].decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise BadInput("%s: header is not valid JSON (%s)" % (path, e))
    if not isinstance(header, dict):
        raise BadInput("%s: header is not a JSON object" % path)
    data = memoryview(blob)[8 + hlen:]
    meta = header.pop("__metadata__", None) or {}
    tensors = {}
    for name, entry in header.items():
        try:
            dt = ST_DTYPES[entry["dtype"]]
            shape = tuple(int(d) for d in entry["shape"])
            begin, end = (int(o) for o in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise BadInput("%s: bad header entry for %r" % (path, name))
        count = int(np.prod(shape, dtype=np.int64))
        if (min(shape, default=0) < 0 or not 0 <= begin <= end <= len(data)
                or end - begin != count * dt.itemsize):
            raise BadInput("%s: tensor %r has inconsistent shape/offsets"
                           % (path, name))
        arr = np.frombuffer(data[begin:end], dtype=dt, count=count)
        tensors[name] = arr.reshape(shape).copy()
    return tensors, meta


def st_write(path, tensors, meta, st_dtypes=None):
    """Writes name -> numpy array (F64/F32/F16/I64/U8) with string metadata.

    st_dtypes optionally maps a name to the safetensors dtype to declare
    when the numpy dtype cannot say it: bfloat16 values are passed as their
    uint16 bit patterns and declared "BF16".
    """
    st_dtypes = st_dtypes or {}
    header = {"__metadata__": {str(k): str(v) for k, v in meta.items()}}
    chunks, offset = [], 0
    for name, arr in tensors.items():
        dt = arr.dtype.newbyteorder("<")
        raw = np.ascontiguousarray(arr, dtype=dt).tobytes()
        header[name] = {"dtype": st_dtypes.get(name) or ST_NAMES[dt],
                        "shape": list(arr.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        chunks.append(raw)
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)  # keep the data block 8-byte aligned
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for raw in chunks:
            f.write(raw)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------
# The case as stored in a golden file
# ---------------------------------------------------------------------------

def quantized(cfg, name):
    """Whether the config's quantization stores parameter `name` packed: a linear weight of the
    layers (not the router's, the shared experts' gate or a norm) its targets name (all of them
    when it has none)."""
    q = cfg.get("quantization")
    m = re.match(r"^(?:decoder\.)?layers\.\d+\.(.*)$", name)
    if not q or not m:
        return False
    tail = m.group(1)
    linear = tail.startswith("moe.experts.w_") or (
        tail.endswith(".weight") and "norm" not in tail
        and not tail.startswith(("moe.gate.", "moe.shared_gate.")))
    targets = q.get("targets")
    return linear and (not targets or any(fnmatch.fnmatchcase(name, g) for g in targets))


CONFIG_DEFAULTS = {
    "quantization": None,  # param.* holds the quantized weights' exact values
    "vocab_size": 64, "max_len": 32, "d_model": 16, "num_heads": 2,
    "d_ff": 32, "num_layers": 2, "num_classes": 4, "norm_first": False,
    "activation": "gelu", "layer_norm_eps": 1e-5, "positional": "sinusoidal",
    "embed_scale": False, "pooling": "mean", "dropout": 0.0,
    "label_smoothing": 0.0, "causal": False,
    # the attention variants (docs/semantics.md section 14)
    "num_kv_heads": None, "position_offset": 0, "rope_style": "neox",
    "rotary_dim": None, "rope_base": 10000.0, "rope_scaling": {"type": "none"},
    "alibi_max_bias": 8.0, "sliding_window": None, "attn_logit_softcap": None,
    "attn_sinks": False, "qk_norm": False, "head_dim": None, "layer_types": None,
    # multi-head latent attention (docs/semantics.md, 14.12)
    "kv_lora_rank": None, "q_lora_rank": None, "qk_nope_head_dim": 0,
    "qk_rope_head_dim": 0, "v_head_dim": 0,
    # the block variants and decoders (docs/semantics.md, section 17)
    "norm": "layernorm", "ffn": "mlp", "ffn_bias": True, "attn_bias": True,
    "attn_out_bias": None, "head_bias": True, "architecture": "encoder", "tie_embeddings": False,
    "decoder_layers": None, "decoder_vocab_size": None, "decoder_positional": None,
    # a real encoder's embeddings and pooler (docs/semantics.md, section 18)
    "type_vocab_size": None, "embedding_norm": False, "pooler": "none", "padding_idx": None,
    # ViT's patch input (docs/semantics.md, section 18.5)
    "input": "tokens", "image_size": None, "patch_size": None, "channels": None,
    # mixtures of experts (docs/semantics.md, section 19)
    "num_experts": None, "num_experts_per_tok": 1, "moe_d_ff": None,
    "router_scoring": "softmax", "router_order": "score_then_topk",
    "router_groups": 1, "topk_groups": 1, "group_score": "top2_sum",
    "norm_topk_prob": False, "routed_scaling_factor": 1.0,
    "router_bias": False, "selection_bias": False, "expert_kind": "swiglu",
    "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "expert_bias": False,
    "weight_at": "output", "shared_d_ff": 0, "shared_expert_gate": False,
    "first_dense_layers": 0, "moe_every": 1, "router_aux_loss_coef": 0.0,
    "router_z_loss_coef": 0.0,
}
TORCH_DTYPES = {"float32": torch.float32, "float64": torch.float64}


def load_case(path):
    tensors, meta = st_read(path)
    if meta.get("format") != "teo-golden/1":
        raise BadInput("%s: __metadata__.format is %r, expected 'teo-golden/1'"
                       % (path, meta.get("format")))
    try:
        cfg_in = json.loads(meta["config"])
        case = json.loads(meta["case"])
    except (KeyError, ValueError) as e:
        raise BadInput("%s: bad config/case metadata (%s)" % (path, e))
    if not isinstance(cfg_in, dict) or not isinstance(case, dict):
        raise BadInput("%s: config/case metadata must be JSON objects" % path)
    unknown = sorted(set(cfg_in) - set(CONFIG_DEFAULTS))
    if unknown:
        raise Unsupported("unknown config keys %s" % ", ".join(unknown))
    cfg = dict(CONFIG_DEFAULTS)
    cfg.update(cfg_in)
    if cfg["activation"] not in ("relu", "gelu", "gelu_tanh", "silu"):
        raise Unsupported("activation %r" % cfg["activation"])
    if cfg["positional"] not in ("sinusoidal", "learned", "none", "rope",
                                 "alibi"):
        raise Unsupported("positional %r" % cfg["positional"])
    if cfg["pooling"] not in ("mean", "cls", "max"):
        raise Unsupported("pooling %r" % cfg["pooling"])
    if cfg["pooler"] not in ("none", "dense_tanh"):
        raise Unsupported("pooler %r" % cfg["pooler"])
    if cfg["input"] not in ("tokens", "patches"):
        raise Unsupported("input %r" % cfg["input"])
    if is_patches(cfg):
        if cfg["architecture"] != "encoder":
            raise Unsupported("input \"patches\" with architecture %r"
                              % cfg["architecture"])
        img, p = cfg["image_size"], cfg["patch_size"]
        if not (isinstance(img, int) and isinstance(p, int)
                and isinstance(cfg["channels"], int) and p > 0 and img % p == 0
                and cfg["channels"] > 0):
            raise BadInput("%s: input \"patches\" needs positive integer "
                           "image_size, patch_size and channels, image_size a "
                           "multiple of patch_size" % path)
    dtype_name = case.get("dtype")
    if dtype_name not in TORCH_DTYPES:
        raise Unsupported("dtype %r" % dtype_name)
    inputs = ("input.tokens", "input.lengths", "input.labels")
    if is_patches(cfg):
        inputs = ("input.pixels", "input.lengths", "input.labels")
    if cfg["architecture"] == "encoder_decoder":
        inputs = ("input.src_tokens", "input.src_lengths", "input.tgt_tokens",
                  "input.tgt_lengths")
    if cfg["type_vocab_size"]:
        inputs += ("input.token_types",)
    for key in inputs:
        if key == "input.labels" and cfg["architecture"] == "decoder":
            continue  # a decoder's targets are its next tokens
        if key not in tensors:
            raise BadInput("%s: missing tensor %s" % (path, key))
    return cfg, case, tensors, meta


def is_patches(cfg):
    """Whether the model reads images cut into patches (ViT) instead of
    tokens."""
    return cfg.get("input", "tokens") == "patches"


def patch_grid(cfg):
    """G, the patches per row and per column of an image: Np = G^2."""
    return cfg["image_size"] // cfg["patch_size"]


def is_moe_layer(cfg, i):
    """Hugging Face's rule: layer i is sparse when i >= first_k_dense_replace
    and (i + 1) % decoder_sparse_step == 0."""
    return cfg["ffn"] == "moe" and i >= cfg["first_dense_layers"] \
        and (i + 1) % cfg["moe_every"] == 0


def moe_param_names(cfg, p):
    names = [p + "moe.gate.weight"]
    if cfg["router_bias"]:
        names.append(p + "moe.gate.bias")
    if cfg["selection_bias"]:
        names.append(p + "moe.gate.e_score_correction_bias")
    for w in ("gate", "up", "down"):
        names.append(p + "moe.experts.w_" + w)
        if cfg["expert_bias"]:
            names.append(p + "moe.experts.b_" + w)
    if cfg["shared_d_ff"]:
        names += [p + "moe.shared.%s.weight" % n for n in ("gate", "fc1", "fc2")]
        if cfg["shared_expert_gate"]:
            names.append(p + "moe.shared_gate.weight")
    return names


def param_names(cfg):
    names = ["embedding.weight"]
    if is_patches(cfg):  # a Conv2d's weight (D, Ch, P, P) and bias, and [CLS]
        names = ["patch_embedding.weight", "patch_embedding.bias", "cls_token"]
    if cfg["positional"] == "learned":
        names.append("pos_embedding.weight")
    if cfg["type_vocab_size"]:
        names.append("token_type_embedding.weight")
    if cfg["embedding_norm"]:
        names.append("embedding_norm.weight")
        if cfg["norm"] == "layernorm":
            names.append("embedding_norm.bias")
    for i in range(cfg["num_layers"]):
        p = "layers.%d." % i
        if is_mla(cfg):
            names += [p + "attn.%s.weight" % n for n in (
                ("q_a", "q_a_norm", "q_b") if cfg["q_lora_rank"] else ("q",))]
            names += [p + "attn.%s.weight" % n for n in ("kv_a", "kv_norm", "kv_b", "o")]
        for proj in ("q", "k", "v", "o") if not is_mla(cfg) else ():
            names += [p + "attn.%s.weight" % proj]
            if out_bias(cfg) if proj == "o" else cfg["attn_bias"]:
                names += [p + "attn.%s.bias" % proj]
        if cfg["qk_norm"]:
            names += [p + "attn.q_norm.weight", p + "attn.k_norm.weight"]
        if cfg["attn_sinks"]:
            names.append(p + "attn.sinks")
        for n in ("norm1", "norm2"):
            names += [p + n + ".weight"]
            if cfg["norm"] == "layernorm":
                names += [p + n + ".bias"]
        if is_moe_layer(cfg, i):
            names += moe_param_names(cfg, p)
            continue
        for n in (("ffn.gate", "ffn.fc1", "ffn.fc2") if cfg["ffn"] != "mlp"
                  else ("ffn.fc1", "ffn.fc2")):
            names += [p + n + ".weight"]
            if cfg["ffn_bias"]:
                names += [p + n + ".bias"]
    if cfg["norm_first"]:
        names += ["final_norm.weight"]
        if cfg["norm"] == "layernorm":
            names += ["final_norm.bias"]
    if cfg["pooler"] == "dense_tanh":
        names += ["pooler.weight", "pooler.bias"]
    head = "lm_head" if cfg["architecture"] == "decoder" else "head"
    if head == "head" or not cfg["tie_embeddings"]:
        names += [head + ".weight"]
    if cfg["head_bias"]:
        names += [head + ".bias"]
    return names


def case_inputs(tensors):
    """tokens (B, S), lengths (B) and labels (B) as int64 tensors; a
    decoder's case has no labels (None), and a case with input "patches"
    no tokens (None: its input.pixels are read by run_case, and S is
    seq_len(cfg, tensors)). (input.token_types, when the config has token
    types, is read by run_case.)"""
    tokens = None
    if "input.tokens" in tensors:
        tokens = torch.from_numpy(tensors["input.tokens"].astype(np.int64))
    lengths = torch.from_numpy(tensors["input.lengths"].astype(np.int64))
    labels = None
    if "input.labels" in tensors:
        labels = torch.from_numpy(tensors["input.labels"].astype(np.int64))
    B = lengths.shape[0] if tokens is None else tokens.shape[0]
    if (tokens is not None and tokens.dim() != 2) or lengths.shape != (B,) \
            or (labels is not None and labels.shape != (B,)):
        raise BadInput("inconsistent input shapes")
    return tokens, lengths, labels


def seq_len(cfg, tensors):
    """S: the tokens' length, or with input "patches" [CLS] and the
    image's Np patches, 1 + Np."""
    if is_patches(cfg):
        return 1 + patch_grid(cfg) ** 2
    return tensors["input.tokens"].shape[1]


def patch_columns(pixels, cfg):
    """The im2col of ViT's patch embedding: pixels (B, Ch, Img, Img) ->
    cols (B, Np, Ch P P), row py G + px holding the patch at (py, px)
    flattened in (Ch, P, P) order, as Conv2d's weight (D, Ch, P, P) is."""
    B, Ch = pixels.shape[0], cfg["channels"]
    G, P = patch_grid(cfg), cfg["patch_size"]
    return (pixels.reshape(B, Ch, G, P, G, P).permute(0, 2, 4, 1, 3, 5)
            .reshape(B, G * G, Ch * P * P))


# ---------------------------------------------------------------------------
# How a case is run: dtype, tf32 GEMMs, deliberate bugs
# ---------------------------------------------------------------------------

RUN_DTYPES = dict(TORCH_DTYPES, bfloat16=torch.bfloat16,
                  float16=torch.float16)

# Deliberate bugs, each a one-line deviation from docs/semantics.md (look
# for `variant.mutant` below). The first five move some stage far beyond
# bfloat16's rounding noise; the last two stay below it and document what a
# low-precision check cannot see.
MUTANTS = {
    "scores_1_over_dh": "attention scores scaled by 1/Dh, not 1/sqrt(Dh)",
    "heads_interleaved": "q, k, v split into heads as (B, S, Dh, H), "
                         "not (B, S, H, Dh)",
    "causal_off_by_one": "the causal mask lets query i see key i+1",
    "pe_base_1000": "sinusoidal positions with base 1000, not 10000",
    "mean_pool_padding": "mean pooling averages all S positions, padding "
                         "included",
    "ln_eps_1e-6": "every LayerNorm uses eps 1e-6, not the config's",
    "gelu_tanh_grad": "exact GELU forward, but the tanh approximation's "
                      "derivative backward",
    # an encoder_decoder's (tests/interop/seq2seq_mutants.py)
    "cross_attn_keys_from_decoder": "cross-attention keys and values from the "
                                    "decoder's stream, not the encoder's output",
    "memory_padding_ignored": "cross-attention without the source padding mask",
    # a mixture of experts' (tests/interop/moe_models.sh)
    "moe_correction_in_weights": "DeepSeek-V3's correction bias added to the "
                                 "weights too, not only to the choice",
    "moe_norm_topk_ignored": "norm_topk_prob ignored",
    "moe_softmax_over_all": "gpt-oss's weights a softmax over all experts, "
                            "not over the k chosen",
    "moe_group_max": "groups scored by their best expert, not their top two",
    "moe_shared_fed_output": "the shared expert fed the routed experts' output, "
                             "not the layer's input",
    "moe_unpermute_wrong": "the experts' rows put back by the sorted index, "
                           "not its inverse",
    "moe_weight_at_output": "Llama 4's routing weight applied at the expert's "
                            "output, not its input",
    "moe_aux_per_token": "the load-balancing loss's f_e counted per token, not "
                         "per (token, slot)",
}


@dataclasses.dataclass(frozen=True)
class Variant:
    """How to run a case. The default is the golden's own arithmetic."""

    dtype: Optional[str] = None  # a RUN_DTYPES key; None: the golden's
    tf32: bool = False  # float32 with GEMM operands rounded to tf32
    mutant: Optional[str] = None  # a MUTANTS key
    transformer_layer: bool = False  # layer outputs from nn modules

    def torch_dtype(self, case):
        return RUN_DTYPES["float32" if self.tf32
                          else self.dtype or case["dtype"]]

    def linear(self, x, weight, bias):
        """y = x W^T + b, as F.linear; with tf32 the product's operands
        are rounded and the bias is added to the float32 product."""
        if not self.tf32:
            return F.linear(x, weight, bias)
        y = tf32_gemm(F.linear, x, weight)
        return y if bias is None else y + bias

    def matmul(self, a, b):
        if not self.tf32:
            return torch.matmul(a, b)
        return tf32_gemm(torch.matmul, a, b)


AS_GOLDEN = Variant()


def variant_problem(variant, cfg, tensors):
    """Why this case cannot be run as `variant`, or None when it can.

    A mutant must be able to change the case: e.g. scaling by 1/Dh instead
    of 1/sqrt(Dh) changes nothing when Dh = 1.
    """
    seq2seq_mutants = ("cross_attn_keys_from_decoder", "memory_padding_ignored")
    if cfg["architecture"] == "encoder_decoder":
        if variant.dtype not in (None, "float32", "float64") or variant.tf32 \
                or variant.transformer_layer:
            return "an encoder_decoder golden has no reduced-precision budget"
        return None
    if variant.mutant in seq2seq_mutants:
        return "mutant %s needs an encoder_decoder" % variant.mutant
    _, lengths, _ = case_inputs(tensors)
    lengths = lengths.tolist()
    S = seq_len(cfg, tensors)
    L, D, H = cfg["num_layers"], cfg["d_model"], cfg["num_heads"]
    Dh = head_dims(cfg)[0]
    if variant.mutant is not None:
        # mutant -> (whether it changes this case, what it needs)
        needs = {
            "scores_1_over_dh": (
                L > 0 and Dh > 1 and max(lengths, default=0) > 0,
                "a layer, d_head > 1 and a real token"),
            "heads_interleaved": (
                L > 0 and H > 1 and Dh > 1 and len(lengths) > 0,
                "a layer, 2 or more heads of d_head > 1 and a batch"),
            "causal_off_by_one": (
                cfg["causal"] and L > 0 and max(lengths, default=0) > 1,
                "the causal mask, a layer and a sequence of 2+ tokens"),
            # Columns 0 and 1 and position 0 are the same for any base.
            "pe_base_1000": (
                cfg["positional"] == "sinusoidal" and S > 1 and D > 2,
                "sinusoidal positions, seq_len > 1 and d_model > 2"),
            "mean_pool_padding": (
                cfg["pooling"] == "mean" and min(lengths, default=S) < S,
                "mean pooling and a sequence with padding"),
            "ln_eps_1e-6": (
                cfg["layer_norm_eps"] != 1e-6 and len(lengths) > 0
                and (L > 0 or cfg["norm_first"] or cfg["embedding_norm"]),
                "a LayerNorm whose eps is not 1e-6, and a batch"),
            "gelu_tanh_grad": (
                cfg["activation"] == "gelu" and L > 0 and len(lengths) > 0,
                "exact GELU, a layer and a batch"),
        }
        moe = cfg["ffn"] == "moe" and len(lengths) > 0
        needs.update({
            "moe_correction_in_weights": (moe and cfg["selection_bias"],
                                          "a correction bias"),
            "moe_norm_topk_ignored": (moe and cfg["norm_topk_prob"]
                                      and cfg["num_experts_per_tok"] > 1,
                                      "norm_topk_prob and k > 1"),
            "moe_softmax_over_all": (
                moe and cfg["router_order"] == "topk_then_score"
                and cfg["router_scoring"] == "softmax",
                "topk_then_score softmax"),
            "moe_group_max": (moe and cfg["router_groups"] > 1
                              and cfg["group_score"] == "top2_sum",
                              "top2_sum groups"),
            "moe_shared_fed_output": (moe and cfg["shared_d_ff"] > 0,
                                      "shared experts"),
            "moe_unpermute_wrong": (moe and cfg["num_experts"] > 1,
                                    "two or more experts"),
            "moe_weight_at_output": (moe and cfg["weight_at"] == "input",
                                     "weight_at input"),
            "moe_aux_per_token": (moe and cfg["router_aux_loss_coef"] > 0
                                  and cfg["num_experts_per_tok"] > 1,
                                  "the load-balancing loss and k > 1"),
        })
        applies, needed = needs[variant.mutant]
        if not applies:
            return "mutant %s needs %s" % (variant.mutant, needed)
    if variant.transformer_layer:
        if has_variants(cfg):
            return "nn.TransformerEncoderLayer has no attention variants"
        if cfg["dropout"] != 0:
            return ("nn.TransformerEncoderLayer cannot replay teo's dropout "
                    "masks")
        if L == 0:
            return "no layer for nn.TransformerEncoderLayer"
        if 0 in lengths:
            return ("nn.TransformerEncoderLayer gives NaN for a length-0 "
                    "sequence")
    return None


def round_to_tf32(x):
    """float32 values rounded to tf32 (8 exponent and 10 explicit mantissa
    bits, stored as float32), to nearest with ties to even.

    Works on the bit pattern: of the 23 mantissa bits the low 13 go. Adding
    0x0FFF plus the lowest kept bit, then clearing the 13 bits, rounds the
    magnitude to nearest with ties to the even neighbour, in both signs (the
    sign bit sits above and is untouched). A carry out of the mantissa bumps
    the exponent, as rounding should (the largest floats become inf, which
    stays inf). NaN is kept as it is: the add could turn its payload into
    inf.
    """
    bits = x.view(torch.int32)
    kept_lsb = (bits >> 13) & 1
    rounded = ((bits + 0x0FFF + kept_lsb) & ~0x1FFF).view(torch.float32)
    return torch.where(torch.isnan(x), x, rounded)


class _Tf32Operand(torch.autograd.Function):
    """A GEMM operand as tf32 hardware reads it: rounded. The rounding is
    not part of the model, so the gradient passes through unchanged."""

    @staticmethod
    def forward(ctx, x):
        return round_to_tf32(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class _Tf32OutputGrad(torch.autograd.Function):
    """The identity forward; backward rounds the GEMM output's gradient dY
    to tf32, since dY is an operand of both backward GEMMs (dA = dY B^T,
    dB = A^T dY, whose other operands were rounded in the forward)."""

    @staticmethod
    def forward(ctx, y):
        return y.clone()

    @staticmethod
    def backward(ctx, grad):
        return round_to_tf32(grad)


def tf32_gemm(gemm, a, b):
    """gemm(a, b) (torch.matmul or F.linear) with tf32 operands, in the
    forward and in both backward products; accumulation stays float32."""
    product = gemm(_Tf32Operand.apply(a), _Tf32Operand.apply(b))
    return _Tf32OutputGrad.apply(product)


class _GeluTanhGrad(torch.autograd.Function):
    """Mutant gelu_tanh_grad: exact GELU forward, but the backward uses the
    derivative of the tanh approximation (docs/semantics.md 8.7)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return F.gelu(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return torch.ops.aten.gelu_backward(grad, x, approximate="tanh")


# ---------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------

def sinusoidal_table(seq_len, d_model, dtype, base=10000.0, offset=0):
    """teo's table: angle and sin/cos in double, each entry rounded once,
    for positions offset .. offset + seq_len - 1.

    (A base other than 10000 is mutant pe_base_1000.)"""
    table = np.empty((seq_len, d_model), dtype=np.float64)
    for pos in range(seq_len):
        for c in range(d_model):
            two_i = c - c % 2
            angle = float(offset + pos) / math.pow(base, float(two_i) / d_model)
            table[pos, c] = math.sin(angle) if c % 2 == 0 else math.cos(angle)
    return torch.from_numpy(table).to(dtype)


class Dropout:
    """Replays teo's saved masks: out = mask ? x * scale : 0."""

    def __init__(self, masks, p, dtype):
        self.masks = masks
        # Real(1 / (1 - p)): computed in double, rounded once to the dtype.
        self.scale = torch.tensor(1.0 / (1.0 - p),
                                  dtype=torch.float64).to(dtype)

    def __call__(self, site, x):
        mask = self.masks.get(site)
        if mask is None:
            return x
        if tuple(mask.shape) != tuple(x.shape):
            raise BadInput("mask %s has shape %s, expected %s"
                           % (site, list(mask.shape), list(x.shape)))
        return torch.where(mask, x * self.scale, torch.zeros_like(x))


def activation_fn(name):
    if name == "relu":
        return F.relu
    if name == "gelu":
        return F.gelu
    if name == "silu":
        return F.silu
    return lambda x: F.gelu(x, approximate="tanh")


def softmax(x):
    """Softmax over the last dimension. In bfloat16 or float16 it runs in
    float32 and rounds its output back, as autocast does: torch 1.13's CPU
    bfloat16 softmax backward subtracts a bfloat16-rounded row sum, which
    cancels (one_head_d7: 20% error in grad.layers.0.attn.q.weight)."""
    if x.dtype in (torch.bfloat16, torch.float16):
        return torch.softmax(x.float(), dim=-1).to(x.dtype)
    return torch.softmax(x, dim=-1)


def rope_inv_freq(cfg, dim, seq_end):
    """RoPE's inverse frequencies and attention factor, as Hugging Face's
    modeling_rope_utils computes them (_compute_default_rope_parameters,
    _compute_linear_scaling_rope_parameters,
    _compute_dynamic_ntk_parameters, _compute_yarn_parameters), written out
    here in float64."""
    sc = cfg["rope_scaling"]
    kind = sc.get("type", "none")
    base = float(cfg["rope_base"])
    factor = float(sc.get("factor", 1.0))
    original = sc.get("original_max_len") or cfg["max_len"]
    if kind == "ntk":
        seq_len = max(seq_end, original)
        base = base * ((factor * seq_len / original) - (factor - 1)) \
            ** (dim / (dim - 2))
    arange = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float64)
    inv_freq = 1.0 / (base ** (arange / dim))
    attention_factor = 1.0
    if kind == "linear":
        inv_freq = inv_freq / factor
    elif kind == "yarn":
        beta_fast = sc.get("beta_fast", 32.0)
        beta_slow = sc.get("beta_slow", 1.0)

        def find_correction_dim(num_rotations):
            return (dim * math.log(original / (num_rotations * 2 * math.pi))) \
                / (2 * math.log(base))
        low, high = find_correction_dim(beta_fast), find_correction_dim(beta_slow)
        if sc.get("truncate", True):  # gpt-oss's truncate false keeps the range fractional
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        linear = (torch.arange(dim // 2, dtype=torch.float64) - low) \
            / (high - low)
        ramp = torch.clamp(linear, 0, 1)
        pos_freqs = base ** (arange / dim)
        extrapolation = 1.0 / pos_freqs
        interpolation = 1.0 / (factor * pos_freqs)
        extrapolation_factor = 1 - ramp
        inv_freq = interpolation * (1 - extrapolation_factor) \
            + extrapolation * extrapolation_factor
        attention_factor = yarn_get_mscale(factor, 1.0)
        if sc.get("mscale") and sc.get("mscale_all_dim"):  # DeepSeek's pair
            attention_factor = yarn_get_mscale(factor, sc["mscale"]) \
                / yarn_get_mscale(factor, sc["mscale_all_dim"])
    return inv_freq, attention_factor


def yarn_get_mscale(factor, m):
    """Hugging Face's get_mscale (DeepSeek's yarn_get_mscale)."""
    return 0.1 * m * math.log(factor) + 1.0 if factor > 1 else 1.0


def is_mla(cfg):
    return cfg["kv_lora_rank"] is not None


def head_dims(cfg):
    """(Dh, Dv): q's and k's head width, and v's (MLA: Dn + Dr and v_head_dim)."""
    if is_mla(cfg):
        return cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    Dh = cfg["head_dim"] or cfg["d_model"] // cfg["num_heads"]
    return Dh, Dh


def score_scale(cfg, Dh, dtype, root=None):
    """1 / sqrt(Dh), times DeepSeek's yarn_get_mscale(factor, mscale_all_dim)^2 when
    rope_scaling is yarn with mscale_all_dim (its attention's softmax_scale)."""
    scale = 1.0 / (math.sqrt(Dh) if root is None else root)
    sc = cfg["rope_scaling"]
    if cfg["positional"] == "rope" and sc.get("type") == "yarn" and sc.get("mscale_all_dim"):
        m = yarn_get_mscale(float(sc["factor"]), sc["mscale_all_dim"])
        scale = scale * (m * m)
    return torch.tensor(scale, dtype=torch.float64).to(dtype)


def rope_rotate(x, cos, sin, style, dim):
    """Rotates the first `dim` features of x (..., S, Dh) by position:
    Hugging Face's q * cos + rotate_half(q) * sin for neox, and the same on
    (even, odd) pairs for interleaved. cos, sin: (S, dim / 2)."""
    rot, rest = x[..., :dim], x[..., dim:]
    if style == "neox":
        c = torch.cat([cos, cos], dim=-1)
        s = torch.cat([sin, sin], dim=-1)
        half = dim // 2
        rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
        out = rot * c + rotated * s
    else:
        even, odd = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack([even * cos - odd * sin, odd * cos + even * sin],
                          dim=-1).flatten(-2)
    return torch.cat([out, rest], dim=-1)


def mla_qkv(attn_in, p, cfg, P, acts, linear, rope):
    """Multi-head latent attention's q, k, v and their rotations (docs/semantics.md, 14.12), as
    DeepSeek-V3's attention computes them: q from the normalised q latent (or from x), the
    compressed kv_a = [c | k_pe], k_nope and v per head from RMSNorm(c), RoPE on the last
    qk_rope_head_dim of q and on k_pe, which every head shares."""
    B, S, _ = attn_in.shape
    H, Dn, Dr, Dv = (cfg["num_heads"], cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"],
                     cfg["v_head_dim"])
    Rkv = cfg["kv_lora_rank"]
    rms = dict(cfg, norm="rmsnorm")
    if cfg["q_lora_rank"]:
        q_a = acts[p + "q_a"] = linear(attn_in, P[p + "attn.q_a.weight"], None)
        q_in = acts[p + "q_a_norm"] = norm(q_a, p + "attn.q_a_norm", P, rms)
        q = linear(q_in, P[p + "attn.q_b.weight"], None)
    else:
        q = linear(attn_in, P[p + "attn.q.weight"], None)
    q = q.reshape(B, S, H, Dn + Dr).transpose(1, 2)
    kv_a = acts[p + "kv_a"] = linear(attn_in, P[p + "attn.kv_a.weight"], None)
    c, k_pe = kv_a[..., :Rkv], kv_a[..., Rkv:]
    kv_norm = acts[p + "kv_norm"] = norm(c, p + "attn.kv_norm", P, rms)
    kv = linear(kv_norm, P[p + "attn.kv_b.weight"], None).reshape(B, S, H, Dn + Dv)
    kv = kv.transpose(1, 2)
    k_nope, v = kv[..., :Dn], kv[..., Dn:]
    pe = k_pe[:, None].expand(B, H, S, Dr)
    k = torch.cat([k_nope, pe], dim=-1)
    cos, sin, dim = rope
    q_rot = torch.cat([q[..., :Dn], rope_rotate(q[..., Dn:], cos, sin, cfg["rope_style"], dim)],
                      dim=-1)
    pe_rot = rope_rotate(k_pe[:, None], cos, sin, cfg["rope_style"], dim).expand(B, H, S, Dr)
    k_rot = torch.cat([k_nope, pe_rot], dim=-1)
    acts[p + "q_rot"], acts[p + "k_rot"] = q_rot, k_rot
    return q, k, v, q_rot, k_rot


def alibi_slopes(num_heads, max_bias):
    """ALiBi slopes as Hugging Face's build_alibi_tensor (BLOOM) computes
    them, with max_bias in place of its fixed 8, in float64."""
    closest = 2 ** math.floor(math.log2(num_heads))
    base = 2 ** (-max_bias / closest)
    powers = torch.arange(1, 1 + closest, dtype=torch.float64)
    slopes = torch.pow(torch.tensor(base, dtype=torch.float64), powers)
    if closest != num_heads:
        extra_base = 2 ** (-max_bias / (2 * closest))
        remaining = min(closest, num_heads - closest)
        extra = torch.arange(1, 1 + 2 * remaining, 2, dtype=torch.float64)
        slopes = torch.cat([slopes, torch.pow(
            torch.tensor(extra_base, dtype=torch.float64), extra)])
    return slopes


def attention(q, k, v, visible, alpha, drop, site, variant=AS_GOLDEN,
              cap=None, bias=None, sink=None):
    """Scaled dot-product attention with teo's treatment of empty rows.

    visible: bool (B, 1 or H, S, S), True where key j is visible to query i.
    cap: the logit soft-cap c; bias: (H, S, S) added after the cap (ALiBi);
    sink: (H) logits that join each row's softmax (gpt-oss).
    Returns scores (-inf where masked), probs (before dropout), context.
    """
    raw = variant.matmul(q, k.transpose(-1, -2)) * alpha
    if cap is not None:
        raw = cap * torch.tanh(raw / cap)
    if bias is not None:
        raw = raw + bias
    scores = raw.masked_fill(~visible, float("-inf"))
    if sink is not None:
        # softmax([scores, sink]) without the sink's column; a row with no
        # visible key gives the sink everything and its keys 0.
        B, H, S, _ = scores.shape
        column = sink.to(scores.dtype)[None, :, None, None].expand(B, H, S, 1)
        probs = softmax(torch.cat([scores, column], dim=-1))[..., :S]
    else:
        # A row with no visible key: PyTorch's softmax would give NaN. teo
        # defines its probs (and every gradient through it) as exactly 0, so
        # the softmax sees a harmless finite row that is then multiplied out.
        has_key = visible.any(dim=-1, keepdim=True)
        safe = scores.masked_fill(~has_key, 0.0)
        probs = torch.where(has_key, softmax(safe), torch.zeros_like(safe))
    context = variant.matmul(drop(site, probs), v)
    return scores, probs, context


def norm(x, prefix, P, cfg):
    """The config's norm: LayerNorm, or RMSNorm (x / sqrt(mean(x^2) + eps) *
    weight, Hugging Face's LlamaRMSNorm), in float32 for bfloat16 and
    float16 as autocast runs norms."""
    eps = cfg["layer_norm_eps"]
    if cfg["norm"] == "layernorm":
        return layer_norm(x, prefix, P, eps)
    w = P[prefix + ".weight"]
    work = torch.float32 if x.dtype in (torch.bfloat16, torch.float16) else x.dtype
    xf = x.to(work)
    y = xf * torch.rsqrt((xf * xf).mean(-1, keepdim=True) + eps) * w.to(work)
    return y.to(x.dtype)


def layer_norm(x, prefix, P, eps):
    """LayerNorm over the last dimension. In bfloat16 or float16 it runs in
    float32 and rounds its output back, as autocast does: torch 1.13's CPU
    bfloat16 layer_norm accumulates its weight and bias gradients in
    bfloat16, which loses up to 15% of grad.layers.0.norm2.bias over the 226
    rows of seq_len_113 (teo's bf16 budget flags it)."""
    w, b = P[prefix + ".weight"], P[prefix + ".bias"]
    if x.dtype in (torch.bfloat16, torch.float16):
        y = F.layer_norm(x.float(), (x.shape[-1],), w.float(), b.float(), eps)
        return y.to(x.dtype)
    return F.layer_norm(x, (x.shape[-1],), w, b, eps)


def encoder_layer(x, i, cfg, P, visible, drop, acts, variant=AS_GOLDEN,
                  rope=None):
    B, S, D = x.shape
    H = cfg["num_heads"]
    Hkv = cfg["num_kv_heads"] or H
    p = "layers.%d." % i
    Dh, Dv = head_dims(cfg)  # head_dim: q and the context H * Dh wide, apart from D
    root = Dh if variant.mutant == "scores_1_over_dh" else math.sqrt(Dh)
    alpha = score_scale(cfg, Dh, x.dtype, root)
    linear = variant.linear

    def heads(y, n=H):
        if variant.mutant == "heads_interleaved":
            return y.reshape(B, S, Dh, n).permute(0, 3, 1, 2)
        return y.reshape(B, S, n, Dh).transpose(1, 2)

    if cfg["norm_first"]:
        attn_in = acts[p + "norm1"] = norm(x, p + "norm1", P, cfg)
    else:
        attn_in = x
    if is_mla(cfg):
        q, k, v, qa, ka = mla_qkv(attn_in, p, cfg, P, acts, linear, rope)
    else:
        q = heads(linear(attn_in, P[p + "attn.q.weight"], P.get(p + "attn.q.bias")))
        k = heads(linear(attn_in, P[p + "attn.k.weight"], P.get(p + "attn.k.bias")),
                  Hkv)
        v = heads(linear(attn_in, P[p + "attn.v.weight"], P.get(p + "attn.v.bias")),
                  Hkv)
    if cfg["qk_norm"]:
        # Qwen3's q_norm and k_norm: an RMSNorm over each head's Dh, before RoPE
        rms = dict(cfg, norm="rmsnorm")
        qa = acts[p + "q_norm"] = norm(q, p + "attn.q_norm", P, rms)
        ka = acts[p + "k_norm"] = norm(k, p + "attn.k_norm", P, rms)
    elif not is_mla(cfg):
        qa, ka = q, k
    if rope is not None and not is_mla(cfg):
        cos, sin, dim = rope
        qa = acts[p + "q_rot"] = rope_rotate(qa, cos, sin, cfg["rope_style"],
                                             dim)
        ka = acts[p + "k_rot"] = rope_rotate(ka, cos, sin, cfg["rope_style"],
                                             dim)
    # Hugging Face's repeat_kv: K/V head g serves query heads g*G .. g*G+G-1.
    ka = ka.repeat_interleave(H // Hkv, dim=1)
    va = v.repeat_interleave(H // Hkv, dim=1)
    bias = None
    if cfg["positional"] == "alibi":
        ij = torch.arange(S)[:, None] - torch.arange(S)[None, :]
        dist = ij if cfg["causal"] else ij.abs()
        slopes = alibi_slopes(H, cfg["alibi_max_bias"])
        bias = (-slopes[:, None, None] * dist.to(torch.float64)).to(x.dtype)
    cap = cfg["attn_logit_softcap"]
    if cap is not None:
        cap = torch.tensor(cap, dtype=torch.float64).to(x.dtype)
    sink = P[p + "attn.sinks"] if cfg["attn_sinks"] else None
    scores, probs, ctx = attention(qa, ka, va, visible, alpha, drop,
                                   "dropout." + p + "attn", variant,
                                   cap=cap, bias=bias, sink=sink)
    context = ctx.transpose(1, 2).reshape(B, S, H * Dv)
    attn_out = linear(context, P[p + "attn.o.weight"], P.get(p + "attn.o.bias"))
    residual1 = x + drop("dropout." + p + "residual1", attn_out)
    acts.update({p + "q": q, p + "k": k, p + "v": v, p + "scores": scores,
                 p + "probs": probs, p + "context": context,
                 p + "attn_out": attn_out, p + "residual1": residual1})

    if cfg["norm_first"]:
        ffn_in = acts[p + "norm2"] = norm(residual1, p + "norm2", P, cfg)
        base = residual1
    else:
        ffn_in = acts[p + "norm1"] = norm(residual1, p + "norm1", P, cfg)
        base = ffn_in
    if is_moe_layer(cfg, i):
        return moe_layer_end(x, ffn_in, base, i, cfg, P, acts, linear,
                             variant.mutant)
    ffn_pre = linear(ffn_in, P[p + "ffn.fc1.weight"], P.get(p + "ffn.fc1.bias"))
    if cfg["ffn"] != "mlp":
        # LLaMA's MLP: down(act(gate(x)) * up(x)), act silu (swiglu) or gelu
        gate = linear(ffn_in, P[p + "ffn.gate.weight"],
                      P.get(p + "ffn.gate.bias"))
        act = activation_fn("silu" if cfg["ffn"] == "swiglu"
                            else cfg["activation"])
        ffn_hidden = act(gate) * ffn_pre
    elif variant.mutant == "gelu_tanh_grad":
        ffn_hidden = _GeluTanhGrad.apply(ffn_pre)
    else:
        ffn_hidden = activation_fn(cfg["activation"])(ffn_pre)
    ffn_out = linear(drop("dropout." + p + "ffn", ffn_hidden),
                     P[p + "ffn.fc2.weight"], P.get(p + "ffn.fc2.bias"))
    residual2 = base + drop("dropout." + p + "residual2", ffn_out)
    if cfg["norm_first"]:
        output = residual2
    else:
        output = acts[p + "norm2"] = norm(residual2, p + "norm2", P, cfg)
    acts.update({p + "ffn_pre": ffn_pre, p + "ffn_hidden": ffn_hidden,
                 p + "ffn_out": ffn_out, p + "residual2": residual2,
                 p + "output": output})
    return output


def route(cfg, logits, given=None):
    """A router's choice (N, k), its weights (N, k), from logits (N, E),
    written from the Hugging Face routers' documented behaviour: scores in
    float32 at least, the correction bias for choosing only, group-limited
    choice, ties to the lower index (a stable descending sort). `given`
    (N, k): a replayed choice, which the weights then follow."""
    E, k = cfg["num_experts"], cfg["num_experts_per_tok"]
    work = torch.float64 if logits.dtype == torch.float64 else torch.float32
    lw = logits.to(work)
    sigmoid = cfg["router_scoring"] == "sigmoid"
    first = cfg["router_order"] == "score_then_topk"
    scores = (torch.sigmoid(lw) if sigmoid else torch.softmax(lw, -1)) \
        if first else lw
    sel = scores.detach().clone()
    mutant = cfg["_mutant"]
    if cfg["_correction"] is not None:
        sel = sel + cfg["_correction"].detach().to(work)
        if mutant == "moe_correction_in_weights":
            scores = scores + cfg["_correction"].detach().to(work)
    G = cfg["router_groups"]
    if G > 1:
        g = sel.view(-1, G, E // G)
        if cfg["group_score"] == "max" or mutant == "moe_group_max":
            gs = g.max(-1).values
        else:
            gs = torch.sort(g, dim=-1, descending=True, stable=True).values[..., :2].sum(-1)
        keep = torch.sort(gs, dim=-1, descending=True, stable=True).indices[:, :cfg["topk_groups"]]
        mask = torch.zeros_like(gs, dtype=torch.bool).scatter_(1, keep, True)
        sel = sel.masked_fill(~mask.repeat_interleave(E // G, 1), -math.inf)
    ids = torch.sort(sel, dim=-1, descending=True, stable=True).indices[:, :k]
    if given is not None:
        ids = given
    if first:
        w = scores.gather(1, ids)
    else:
        chosen = lw.gather(1, ids)
        w = torch.sigmoid(chosen) if sigmoid else torch.softmax(chosen, -1)
        if mutant == "moe_softmax_over_all":
            w = torch.softmax(lw, -1).gather(1, ids)
    if cfg["norm_topk_prob"] and mutant != "moe_norm_topk_ignored":
        w = w / w.sum(-1, keepdim=True)
    w = w * cfg["routed_scaling_factor"]
    return ids, w.to(logits.dtype), lw


def moe_layer_end(x, ffn_in, base, i, cfg, P, acts, linear, mutant=None):
    """An MoE layer's FFN (docs/semantics.md, 19.2-19.4) and the rest of the
    layer: every position routed, the (position, slot) pairs sorted by
    expert, stably; each expert over its rows; the shared experts added."""
    B, S, D = ffn_in.shape
    E, k = cfg["num_experts"], cfg["num_experts_per_tok"]
    p = "layers.%d." % i
    m = p + "moe."
    h = ffn_in.reshape(B * S, D)
    cfg = dict(cfg, _correction=P.get(m + "gate.e_score_correction_bias"),
               _mutant=mutant)
    logits = linear(h, P[m + "gate.weight"], P.get(m + "gate.bias"))
    ids, w, _ = route(cfg, logits, cfg.get("_routing", {}).get(i))
    pairs = ids.reshape(-1)
    order = torch.sort(pairs, dim=0, stable=True).indices  # rows: pair indices
    counts = torch.bincount(pairs, minlength=E)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
    token = order // k
    x_rows = h[token]
    at_input = cfg["weight_at"] == "input" and mutant != "moe_weight_at_output"
    if at_input:
        x_rows = x_rows * w.reshape(-1)[order][:, None]
    outs, hiddens = [], []
    for e in range(E):
        a, b = int(offsets[e]), int(offsets[e + 1])
        xe = x_rows[a:b]
        gate = linear(xe, P[m + "experts.w_gate"][e],
                      P[m + "experts.b_gate"][e] if cfg["expert_bias"] else None)
        up = linear(xe, P[m + "experts.w_up"][e],
                    P[m + "experts.b_up"][e] if cfg["expert_bias"] else None)
        if cfg["expert_kind"] == "clamped_swiglu":
            lim = cfg["swiglu_limit"]
            g = gate.clamp(max=lim)
            u = up.clamp(min=-lim, max=lim)
            hid = (u + 1) * g * torch.sigmoid(cfg["swiglu_alpha"] * g)
        else:
            hid = F.silu(gate) * up
        hiddens.append(hid)
        outs.append(linear(hid, P[m + "experts.w_down"][e],
                           P[m + "experts.b_down"][e] if cfg["expert_bias"] else None))
    expert_out = torch.cat(outs)
    # back to (position, slot) order, then the slots summed in order
    back = torch.empty_like(expert_out)
    if mutant == "moe_unpermute_wrong":
        back = expert_out[order].reshape(B * S, k, D)
    else:
        back = back.index_copy(0, order, expert_out).reshape(B * S, k, D)
    if at_input:
        terms = back
    else:
        terms = back * w[:, :, None]
    y = terms[:, 0]
    for j in range(1, k):
        y = y + terms[:, j]
    acts.update({m + "logits": logits.reshape(B, S, E),
                 m + "topk_ids": ids.reshape(B, S, k).to(torch.int32),
                 m + "topk_weights": w.reshape(B, S, k),
                 m + "expert_offsets": offsets.to(torch.int32),
                 m + "source_rows": order.to(torch.int32),
                 m + "expert_in": x_rows, m + "expert_hidden": torch.cat(hiddens),
                 m + "expert_out": expert_out})
    if cfg["shared_d_ff"]:
        if mutant == "moe_shared_fed_output":
            h = y
        raw = linear(F.silu(linear(h, P[m + "shared.gate.weight"], None))
                     * linear(h, P[m + "shared.fc1.weight"], None),
                     P[m + "shared.fc2.weight"], None)
        if cfg["shared_expert_gate"]:
            raw = torch.sigmoid(linear(h, P[m + "shared_gate.weight"], None)) * raw
        acts[m + "shared_out"] = raw.reshape(B, S, D)
        y = y + raw
    ffn_out = y.reshape(B, S, D)
    residual2 = base + ffn_out
    if cfg["norm_first"]:
        output = residual2
    else:
        output = acts[p + "norm2"] = norm(residual2, p + "norm2", P, cfg)
    acts.update({p + "ffn_out": ffn_out, p + "residual2": residual2,
                 p + "output": output})
    return output


def moe_losses(cfg, acts, lengths, S, mutant=None):
    """The load-balancing and z losses over every MoE layer's real tokens,
    concatenated in layer order (Hugging Face's load_balancing_loss_func,
    ST-MoE's z-loss): (aux, z), None for a term that is off."""
    real = (torch.arange(S)[None, :] < lengths[:, None]).reshape(-1)
    logits, ids = [], []
    for i in range(cfg["num_layers"]):
        if is_moe_layer(cfg, i):
            m = "layers.%d.moe." % i
            logits.append(acts[m + "logits"].reshape(-1, cfg["num_experts"])[real])
            ids.append(acts[m + "topk_ids"].reshape(-1, cfg["num_experts_per_tok"])[real])
    lg = torch.cat(logits)
    work = torch.float64 if lg.dtype == torch.float64 else torch.float32
    lw, E = lg.to(work), cfg["num_experts"]
    T = lw.shape[0]
    aux = z = None
    if cfg["router_aux_loss_coef"]:
        if T == 0:
            aux = lw.sum() * 0
        else:
            f = torch.bincount(torch.cat(ids).reshape(-1).long(), minlength=E).to(work) / T
            if mutant == "moe_aux_per_token":
                f = f / cfg["num_experts_per_tok"]
            aux = E * (f * torch.softmax(lw, -1).mean(0)).sum()
    if cfg["router_z_loss_coef"]:
        z = (torch.logsumexp(lw, -1) ** 2).mean() if T else lw.sum() * 0
    return aux, z


def pool(top, lengths, kind):
    """Pooling over the real tokens s < len; a length-0 sequence pools to 0."""
    B, S, D = top.shape
    real = torch.arange(S)[None, :] < lengths[:, None]          # (B, S)
    nonempty = (lengths > 0)[:, None]                            # (B, 1)
    zeros = torch.zeros((B, D), dtype=top.dtype)
    if kind == "mean":
        total = torch.where(real[:, :, None], top,
                            torch.zeros_like(top)).sum(dim=1)
        inv = 1.0 / lengths.clamp(min=1).to(top.dtype)  # 1 / Real(len)
        return torch.where(nonempty, total * inv[:, None], zeros)
    if kind == "cls":
        return torch.where(nonempty, top[:, 0, :], zeros)
    # max: the first maximum over the real tokens (teo's strict '>' scan).
    with torch.no_grad():
        masked = top.masked_fill(~real[:, :, None], float("-inf"))
        best = masked.max(dim=1, keepdim=True).values
        is_best = (masked == best) & real[:, :, None]
        # The first s that attains the maximum (S, clamped, when the
        # sequence is empty; that row is replaced by 0 below).
        first = torch.where(is_best, torch.arange(S)[None, :, None],
                            torch.full_like(is_best, S, dtype=torch.long))
        index = first.min(dim=1, keepdim=True).values.clamp(max=S - 1)
    picked = top.gather(1, index).squeeze(1)
    return torch.where(nonempty, picked, zeros)


def loss_fn(logits, labels, smoothing):
    if logits.shape[0] == 0:
        # teo: the mean over an empty batch is 0 (PyTorch gives NaN).
        return logits.sum()
    if logits.dtype in (torch.bfloat16, torch.float16):
        # in float32, as autocast runs it; the loss is stored back rounded
        return F.cross_entropy(logits.float(), labels,
                               label_smoothing=smoothing).to(logits.dtype)
    return F.cross_entropy(logits, labels, label_smoothing=smoothing)


def lm_loss_fn(lm_logits, tokens, lengths, smoothing):
    """Next-token cross-entropy: position t of sequence b predicts token
    t + 1 when t + 1 < lengths[b]; the rest are ignore_index (-100), and
    the mean is over the counted positions (0 when there are none, where
    PyTorch gives NaN)."""
    B, S, V = lm_logits.shape
    t = torch.arange(S)[None, :]
    nxt = torch.cat([tokens[:, 1:], tokens[:, :1]], dim=1)
    targets = torch.where(t + 1 < lengths[:, None], nxt,
                          torch.full_like(tokens, -100)).reshape(-1)
    logits = lm_logits.reshape(B * S, V)
    if not bool((targets != -100).any()):
        return logits.sum() * 0
    if logits.dtype in (torch.bfloat16, torch.float16):
        return F.cross_entropy(logits.float(), targets,
                               label_smoothing=smoothing).to(logits.dtype)
    return F.cross_entropy(logits, targets, label_smoothing=smoothing)


def visibility(cfg, lengths, S, off_by_one=False):
    """visible[b, 0, i, j] (B, 1, S, S): key j is a real token, and (causal)
    j <= i, and (sliding window W) i - j < W, or |i - j| < W without the
    causal mask. off_by_one: mutant causal_off_by_one."""
    B = lengths.shape[0]
    j = torch.arange(S)
    visible = j[None, None, :] < lengths[:, None, None]           # (B, 1, S)
    visible = visible.expand(B, S, S)
    if cfg["causal"]:
        reach = 1 if off_by_one else 0
        visible = visible & (j[None, :, None] + reach >= j[None, None, :])
    if cfg["sliding_window"] is not None:
        dist = (j[:, None] - j[None, :]).abs()
        visible = visible & (dist < cfg["sliding_window"])[None]
    return visible[:, None, :, :]


def rope_tables(cfg, S, dtype):
    """(cos, sin, rotary_dim) for positions position_offset .. + S - 1, or
    None without RoPE: the angles in float64, cos and sin rounded once."""
    if cfg["positional"] != "rope":
        return None
    P0 = cfg["position_offset"]
    Dh = head_dims(cfg)[0]
    dim = cfg["rotary_dim"] if cfg["rotary_dim"] is not None else Dh
    if is_mla(cfg):
        dim = cfg["qk_rope_head_dim"]  # the last Dr of each head
    inv_freq, factor = rope_inv_freq(cfg, dim, P0 + S)
    pos = torch.arange(P0, P0 + S, dtype=torch.float64)
    freqs = pos[:, None] * inv_freq[None, :]                   # (S, dim/2)
    return ((freqs.cos() * factor).to(dtype), (freqs.sin() * factor).to(dtype),
            dim)


def decoder_layer(x, memory, i, cfg, P, self_vis, cross_vis, acts, variant=AS_GOLDEN):
    """An encoder_decoder's decoder layer (docs/semantics.md, section 17.4): causal
    self-attention, cross-attention over the memory (the source padding mask in cross_vis), the
    FFN, each with its residual and norm (post-norm after it, pre-norm before it)."""
    B, T, D = x.shape
    H = cfg["num_heads"]
    Dh = D // H
    p = "decoder.layers.%d." % i
    alpha = torch.tensor(1.0 / math.sqrt(Dh), dtype=torch.float64).to(x.dtype)
    linear = variant.linear
    none = Dropout({}, 0.0, x.dtype)

    def attend(name, q_in, kv_in, visible):
        b = p + name + "."
        S = kv_in.shape[1]
        q = linear(q_in, P[b + "q.weight"], P.get(b + "q.bias")).reshape(B, T, H, Dh)
        k = linear(kv_in, P[b + "k.weight"], P.get(b + "k.bias")).reshape(B, S, H, Dh)
        v = linear(kv_in, P[b + "v.weight"], P.get(b + "v.bias")).reshape(B, S, H, Dh)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        scores, probs, ctx = attention(q, k, v, visible, alpha, none, "", variant)
        context = ctx.transpose(1, 2).reshape(B, T, D)
        out = linear(context, P[b + "o.weight"], P.get(b + "o.bias"))
        acts.update({b + "q": q, b + "k": k, b + "v": v, b + "scores": scores,
                     b + "probs": probs, b + "context": context, b + "out": out})
        return out

    def block(h, norm_name, residual_name, sub):
        if cfg["norm_first"]:
            n = acts[p + norm_name] = norm(h, p + norm_name, P, cfg)
            r = acts[p + residual_name] = h + sub(n)
            return r
        r = acts[p + residual_name] = h + sub(h)
        acts[p + norm_name] = norm(r, p + norm_name, P, cfg)
        return acts[p + norm_name]

    h = block(x, "norm1", "residual1", lambda a: attend("self_attn", a, a, self_vis))
    kv_source = h if variant.mutant == "cross_attn_keys_from_decoder" else memory
    h = block(h, "norm2", "residual2", lambda a: attend(
        "cross_attn", a, a if kv_source is h else kv_source,
        self_vis if kv_source is h else cross_vis))

    def ffn(a):
        pre = linear(a, P[p + "ffn.fc1.weight"], P.get(p + "ffn.fc1.bias"))
        if cfg["ffn"] != "mlp":
            gate = linear(a, P[p + "ffn.gate.weight"], P.get(p + "ffn.gate.bias"))
            hidden = activation_fn("silu" if cfg["ffn"] == "swiglu"
                                   else cfg["activation"])(gate) * pre
        else:
            hidden = activation_fn(cfg["activation"])(pre)
        out = linear(hidden, P[p + "ffn.fc2.weight"], P.get(p + "ffn.fc2.bias"))
        acts.update({p + "ffn_pre": pre, p + "ffn_hidden": hidden, p + "ffn_out": out})
        return out

    out = acts[p + "output"] = block(h, "norm3", "residual3", ffn)
    return out


def run_seq2seq_case(cfg, case, tensors, variant=AS_GOLDEN):
    """An encoder_decoder's forward and backward (docs/semantics.md, section 17.5): the encoder as
    run_case's, the decoder over the target with the encoder's output as its memory, the LM head
    and the next-token loss over the target. Returns what run_case returns."""
    dtype = variant.torch_dtype(case)
    src = torch.from_numpy(tensors["input.src_tokens"].astype(np.int64))
    src_len = torch.from_numpy(tensors["input.src_lengths"].astype(np.int64))
    tgt = torch.from_numpy(tensors["input.tgt_tokens"].astype(np.int64))
    tgt_len = torch.from_numpy(tensors["input.tgt_lengths"].astype(np.int64))
    P = {k[len("param."):]: torch.from_numpy(v.copy()).to(dtype).requires_grad_(True)
         for k, v in tensors.items() if k.startswith("param.")}
    (B, S), T, D = src.shape, tgt.shape[1], cfg["d_model"]
    scale = torch.tensor(math.sqrt(D) if cfg["embed_scale"] else 1.0,
                         dtype=torch.float64).to(dtype)
    acts = {}
    none = Dropout({}, 0.0, dtype)

    def positions(n, table, kind):
        P0 = cfg["position_offset"]
        if kind == "learned":
            return P[table][P0:P0 + n]
        if kind == "sinusoidal":
            return sinusoidal_table(n, D, dtype, 10000.0, P0).requires_grad_(True)
        return torch.zeros((n, D), dtype=dtype, requires_grad=True)

    embedding = F.embedding(src, P["embedding.weight"]) * scale
    positional = positions(S, "pos_embedding.weight", cfg["positional"])
    x = embedding + positional
    acts.update({"embedding": embedding, "positional": positional, "input": x})
    enc_vis = visibility(cfg, src_len, S)
    for i in range(cfg["num_layers"]):
        x = encoder_layer(x, i, cfg, P, enc_vis, none, acts, variant, None)
    if cfg["norm_first"]:
        x = acts["final_norm"] = norm(x, "final_norm", P, cfg)
    memory = x
    w_tgt = P["decoder.embedding.weight" if cfg["decoder_vocab_size"] else "embedding.weight"]
    d_embedding = F.embedding(tgt, w_tgt) * scale
    d_positional = positions(T, "decoder.pos_embedding.weight",
                             cfg["decoder_positional"] or cfg["positional"])
    y = d_embedding + d_positional
    acts.update({"decoder.embedding": d_embedding, "decoder.positional": d_positional,
                 "decoder.input": y})
    self_vis = visibility(dict(cfg, causal=True, sliding_window=None), tgt_len, T)
    j = torch.arange(S)
    cross_vis = (j[None, None, :] < src_len[:, None, None]).expand(B, T, S)[:, None]
    if variant.mutant == "memory_padding_ignored":
        cross_vis = torch.ones_like(cross_vis)
    layers = cfg["decoder_layers"] if cfg["decoder_layers"] is not None else cfg["num_layers"]
    for i in range(layers):
        y = decoder_layer(y, memory, i, cfg, P, self_vis, cross_vis, acts, variant)
    if cfg["norm_first"]:
        y = acts["decoder.final_norm"] = norm(y, "decoder.final_norm", P, cfg)
    w = w_tgt if cfg["tie_embeddings"] else P["lm_head.weight"]
    lm_logits = acts["lm_logits"] = variant.linear(y, w, P.get("lm_head.bias"))
    loss = acts["loss"] = lm_loss_fn(lm_logits, tgt, tgt_len, cfg["label_smoothing"])
    for t in acts.values():
        if t.requires_grad and not t.is_leaf:
            t.retain_grad()
    loss.backward()

    def grad_of(t):
        return torch.zeros_like(t) if t.grad is None else t.grad
    return (acts, {n: grad_of(t) for n, t in acts.items()},
            {n: grad_of(t) for n, t in P.items()}, (P, src_len, tgt_len))


def cross_check_seq2seq(cfg, acts, extra, name):
    """Compares the decoder's top (and the encoder's output) with PyTorch's own modules fed teo's
    parameters: nn.Transformer for pre-norm (its final norms are teo's), nn.TransformerEncoder and
    nn.TransformerDecoder without a final norm for post-norm. Real positions of sequences whose
    source and target are not empty (PyTorch gives NaN there); LayerNorm, a biased MLP and ReLU
    or GELU only. Raises Mismatch beyond the bound."""
    P, src_len, tgt_len = extra
    if cfg["norm"] != "layernorm" or cfg["ffn"] != "mlp" or not cfg["ffn_bias"] or \
            not cfg["attn_bias"] or not out_bias(cfg) or \
            cfg["activation"] not in ("relu", "gelu"):
        return False
    x, y = acts["input"].detach(), acts["decoder.input"].detach()
    dtype = x.dtype
    D, H = cfg["d_model"], cfg["num_heads"]
    layers_dec = cfg["decoder_layers"] if cfg["decoder_layers"] is not None else cfg["num_layers"]
    model = torch.nn.Transformer(
        D, H, cfg["num_layers"], layers_dec, cfg["d_ff"], dropout=0.0,
        activation=cfg["activation"], layer_norm_eps=cfg["layer_norm_eps"], batch_first=True,
        norm_first=cfg["norm_first"], dtype=dtype)
    if not cfg["norm_first"]:
        model.encoder.norm = None
        model.decoder.norm = None
    params = {}

    def attn(theirs, ours):
        params[theirs + ".in_proj_weight"] = torch.cat([P[ours + "." + n + ".weight"] for n in "qkv"])
        params[theirs + ".in_proj_bias"] = torch.cat([P[ours + "." + n + ".bias"] for n in "qkv"])
        params[theirs + ".out_proj.weight"] = P[ours + ".o.weight"]
        params[theirs + ".out_proj.bias"] = P[ours + ".o.bias"]

    def lin(theirs, ours):
        params[theirs + ".weight"], params[theirs + ".bias"] = P[ours + ".weight"], P[ours + ".bias"]
    for i in range(cfg["num_layers"]):
        a, b = "encoder.layers.%d." % i, "layers.%d." % i
        attn(a + "self_attn", b + "attn")
        lin(a + "linear1", b + "ffn.fc1")
        lin(a + "linear2", b + "ffn.fc2")
        lin(a + "norm1", b + "norm1")
        lin(a + "norm2", b + "norm2")
    for i in range(layers_dec):
        a, b = "decoder.layers.%d." % i, "decoder.layers.%d." % i
        attn(a + "self_attn", b + "self_attn")
        attn(a + "multihead_attn", b + "cross_attn")
        lin(a + "linear1", b + "ffn.fc1")
        lin(a + "linear2", b + "ffn.fc2")
        for n in ("norm1", "norm2", "norm3"):
            lin(a + n, b + n)
    if cfg["norm_first"]:
        lin("encoder.norm", "final_norm")
        lin("decoder.norm", "decoder.final_norm")
    T, S = y.shape[1], x.shape[1]
    src_pad = torch.arange(S)[None, :] >= src_len[:, None]
    tgt_pad = torch.arange(T)[None, :] >= tgt_len[:, None]
    causal = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
    with torch.no_grad():
        memory = torch.nn.utils.stateless.functional_call(
            model.encoder, {k[len("encoder."):]: v for k, v in params.items()
                            if k.startswith("encoder.")}, (x,),
            {"src_key_padding_mask": src_pad})
        ref = torch.nn.utils.stateless.functional_call(
            model.decoder, {k[len("decoder."):]: v for k, v in params.items()
                            if k.startswith("decoder.")}, (y, memory),
            {"tgt_mask": causal, "tgt_key_padding_mask": tgt_pad,
             "memory_key_padding_mask": src_pad})
    top = "decoder.final_norm" if cfg["norm_first"] else "decoder.layers.%d.output" % (layers_dec - 1)
    enc_top = "final_norm" if cfg["norm_first"] else "layers.%d.output" % (cfg["num_layers"] - 1)
    tol = 1e-4 if dtype == torch.float32 else 1e-10
    ok_seq = (src_len > 0) & (tgt_len > 0)
    for what, theirs, ours, lengths in (("the encoder's output", memory, acts[enc_top], src_len),
                                        ("the decoder's top", ref, acts[top], tgt_len)):
        ours = ours.detach()
        real = (torch.arange(ours.shape[1])[None, :] < lengths[:, None]) & ok_seq[:, None]
        diff = torch.where(real[:, :, None], (theirs - ours).abs(), torch.zeros_like(ours))
        scale = max(1.0, float(ours.abs().max()))
        err = float(diff.max()) if diff.numel() else 0.0
        if not err <= tol * scale:
            raise Mismatch("%s: %s differs from nn.Transformer's by %.3g (bound %.3g)"
                           % (name, what, err, tol * scale))
    return True


def run_case(cfg, case, tensors, variant=AS_GOLDEN):
    """Forward + backward.

    Returns (acts, grads of acts, grads of params, extras for the
    cross-check), each a name -> tensor dict in the run's dtype: the case
    dtype unless `variant` says otherwise. The parameters are read in the
    case dtype and converted with torch's .to(), which rounds to nearest
    even (from float64 to bfloat16 or float16 it goes through float32).
    """
    if cfg["architecture"] == "encoder_decoder":
        problem = variant_problem(variant, cfg, tensors)
        if problem:
            raise Unsupported(problem)
        return run_seq2seq_case(cfg, case, tensors, variant)
    golden_dtype = TORCH_DTYPES[case["dtype"]]
    dtype = variant.torch_dtype(case)
    tokens, lengths, labels = case_inputs(tensors)
    problem = variant_problem(variant, cfg, tensors)
    if problem:
        raise Unsupported(problem)
    if variant.mutant == "ln_eps_1e-6":
        cfg = dict(cfg, layer_norm_eps=1e-6)
    B, S = lengths.shape[0], seq_len(cfg, tensors)
    D = cfg["d_model"]
    # router replay: a golden's given routing (input.layers.{i}.moe.topk_ids)
    # is used instead of this backend's own choice
    cfg = dict(cfg, _routing={
        int(key.split(".")[2]): torch.from_numpy(
            tensors[key].astype(np.int64)).reshape(-1, cfg["num_experts_per_tok"])
        for key in tensors if key.startswith("input.layers.")
        and key.endswith(".moe.topk_ids")})

    P = {}
    for name in param_names(cfg):
        key = "param." + name
        if key not in tensors:
            raise BadInput("missing tensor %s" % key)
        t = torch.from_numpy(tensors[key].copy())
        if t.dtype != golden_dtype:
            raise BadInput("%s is %s, expected %s"
                           % (key, t.dtype, golden_dtype))
        P[name] = t.to(dtype).requires_grad_(True)
    extra = sorted(k for k in tensors if k.startswith("param.")
                   and k[len("param."):] not in P)
    if extra:
        raise BadInput("unexpected parameter %s" % extra[0])

    masks = {k: torch.from_numpy(v != 0) for k, v in tensors.items()
             if k.startswith("dropout.")}
    drop = Dropout(masks, cfg["dropout"], dtype)

    acts = {}
    if is_patches(cfg):
        # ViT (docs/semantics.md, section 18.5): row 0 of each image is
        # [CLS], row 1 + n patch n's linear map, cols W^T then + bias, as
        # teo computes it (the tf32 variant rounds the product's operands);
        # cross_check_patches compares it with F.conv2d(pixels, W, b,
        # stride=P). The pixels are inputs: no gradient.
        pixels = tensors["input.pixels"]
        Ch, img = cfg["channels"], cfg["image_size"]
        if tuple(pixels.shape) != (B, Ch, img, img):
            raise BadInput("input.pixels has shape %s, expected %s"
                           % (list(pixels.shape), [B, Ch, img, img]))
        want = np.dtype(np.float64 if golden_dtype == torch.float64
                        else np.float32)
        if pixels.dtype != want:
            raise BadInput("input.pixels is %s, expected %s"
                           % (pixels.dtype, want))
        cols = patch_columns(torch.from_numpy(pixels.copy()).to(dtype), cfg)
        weight = P["patch_embedding.weight"].reshape(D, -1)  # (D, Ch P P)
        patches = variant.linear(cols, weight, None) \
            + P["patch_embedding.bias"]
        embedding = torch.cat(
            [P["cls_token"].expand(B, 1, D), patches], dim=1)
    else:
        scale = torch.tensor(math.sqrt(D) if cfg["embed_scale"] else 1.0,
                             dtype=torch.float64).to(dtype)
        # padding_idx: that row gets no gradient from the lookup, as
        # nn.Embedding(padding_idx)
        embedding = F.embedding(tokens, P["embedding.weight"],
                                padding_idx=cfg["padding_idx"]) * scale
    P0 = 0 if is_patches(cfg) else cfg["position_offset"]
    if cfg["positional"] == "learned":
        positional = P["pos_embedding.weight"][P0:P0 + S]
    elif cfg["positional"] == "sinusoidal":
        base = 1000.0 if variant.mutant == "pe_base_1000" else 10000.0
        positional = sinusoidal_table(S, D, dtype, base,
                                      P0).requires_grad_(True)
    else:  # none, rope and alibi add nothing to the embeddings
        positional = torch.zeros((S, D), dtype=dtype, requires_grad=True)
    acts.update({"embedding": embedding, "positional": positional})
    if cfg["type_vocab_size"]:
        # BERT's order of additions: (embedding + token_type) + positional
        token_types = torch.from_numpy(
            tensors["input.token_types"].astype(np.int64))
        if tuple(token_types.shape) != (B, S):
            raise BadInput("input.token_types has shape %s, expected %s"
                           % (list(token_types.shape), [B, S]))
        token_type = acts["token_type"] = F.embedding(
            token_types, P["token_type_embedding.weight"])
        x = (embedding + token_type) + positional
    else:
        x = embedding + positional
    if cfg["embedding_norm"]:
        x = acts["embedding_norm"] = norm(x, "embedding_norm", P, cfg)
    x = acts["input"] = drop("dropout.input", x)

    visible = visibility(cfg, lengths, S, variant.mutant == "causal_off_by_one")
    # layer_types: a "full_attention" layer has no window
    full = visibility(dict(cfg, sliding_window=None), lengths, S,
                      variant.mutant == "causal_off_by_one")
    types = cfg["layer_types"] or ["sliding_attention"] * cfg["num_layers"]
    rope = rope_tables(cfg, S, dtype)
    for i in range(cfg["num_layers"]):
        vis = full if types[i] == "full_attention" else visible
        x = encoder_layer(x, i, cfg, P, vis, drop, acts, variant, rope)
    if cfg["norm_first"]:
        x = acts["final_norm"] = norm(x, "final_norm", P, cfg)
    if cfg["architecture"] == "decoder":
        w = P["embedding.weight"] if cfg["tie_embeddings"] else P["lm_head.weight"]
        lm_logits = acts["lm_logits"] = variant.linear(x, w, P.get("lm_head.bias"))
        loss = lm_loss_fn(lm_logits, tokens, lengths, cfg["label_smoothing"])
        if cfg["ffn"] == "moe":
            aux, z = moe_losses(cfg, acts, lengths, S, variant.mutant)
            if aux is not None:
                acts["moe_aux_loss"] = aux.to(dtype)
                loss = loss + cfg["router_aux_loss_coef"] * acts["moe_aux_loss"]
            if z is not None:
                acts["moe_z_loss"] = z.to(dtype)
                loss = loss + cfg["router_z_loss_coef"] * acts["moe_z_loss"]
        acts["loss"] = loss
    elif variant.mutant == "mean_pool_padding":
        pooled = pool(x, torch.full_like(lengths, S), cfg["pooling"])
    else:
        pooled = pool(x, lengths, cfg["pooling"])
    if cfg["architecture"] != "decoder":
        acts["pooled"] = head_in = pooled
        if cfg["pooler"] == "dense_tanh":  # BERT's pooler
            head_in = acts["pooler"] = torch.tanh(variant.linear(
                pooled, P["pooler.weight"], P["pooler.bias"]))
        logits = acts["logits"] = variant.linear(head_in, P["head.weight"],
                                                 P.get("head.bias"))
        loss = acts["loss"] = loss_fn(logits, labels, cfg["label_smoothing"])

    for t in acts.values():
        if t.requires_grad and not t.is_leaf:
            t.retain_grad()
    loss.backward()

    def grad_of(t):
        if t.grad is None:
            return torch.zeros_like(t)
        return t.grad
    act_grads = {n: grad_of(t) for n, t in acts.items()}
    param_grads = {n: grad_of(t) for n, t in P.items()}
    return acts, act_grads, param_grads, (P, lengths, visible)


def generation_logits(cfg, case, tensors, variant=AS_GOLDEN):
    """A generation case's steps without a cache: each sequence grown by
    the tokens it is fed (its prompt, then input.generate.tokens (T, B))
    runs through the whole causal forward in eval mode, and step t's
    logits are its LM logits at position lengths[b] + t."""
    if "input.generate.tokens" not in tensors:
        return {}
    tokens = tensors["input.tokens"].astype(np.int64)
    lengths = tensors["input.lengths"].astype(np.int64)
    fed = tensors["input.generate.tokens"].astype(np.int64)
    T, B = fed.shape
    S2 = int(max(int(n) + T for n in lengths))
    grown = np.zeros((B, S2), dtype=np.int64)
    for b in range(B):
        n = int(lengths[b])
        grown[b, :n] = tokens[b, :n]
        grown[b, n:n + T] = fed[:, b]
    eval_tensors = {k: v for k, v in tensors.items()
                    if k.startswith("param.")}
    eval_tensors["input.tokens"] = grown
    eval_tensors["input.lengths"] = lengths + T
    eval_case = dict(case, seq_len=S2)
    eval_case.pop("generate", None)
    acts = run_case(dict(cfg, dropout=0.0), eval_case, eval_tensors,
                    variant)[0]
    lm = acts["lm_logits"].detach()
    rows = torch.arange(B)
    return {"generate.%d.logits" % t: lm[rows, torch.from_numpy(lengths + t)]
            for t in range(T)}


def required_act_names(cfg):
    names = ["embedding", "positional"]
    if cfg["type_vocab_size"]:
        names.append("token_type")
    if cfg["embedding_norm"]:
        names.append("embedding_norm")
    names.append("input")
    for i in range(cfg["num_layers"]):
        p = "layers.%d." % i
        names += [p + n for n in (
            "norm1", "q", "k", "v", "scores", "probs", "context", "attn_out",
            "residual1", "norm2", "ffn_hidden", "ffn_out", "output")
            if n != "ffn_hidden" or not is_moe_layer(cfg, i)]
        if cfg["qk_norm"]:
            names += [p + "q_norm", p + "k_norm"]
        if cfg["positional"] == "rope":
            names += [p + "q_rot", p + "k_rot"]
        if is_mla(cfg):
            names += [p + "kv_a", p + "kv_norm"]
            if cfg["q_lora_rank"]:
                names += [p + "q_a", p + "q_a_norm"]
    if cfg["norm_first"]:
        names.append("final_norm")
    if cfg["architecture"] == "decoder":
        return names + ["lm_logits", "loss"]
    pooler = ["pooler"] if cfg["pooler"] == "dense_tanh" else []
    return names + ["pooled"] + pooler + ["logits", "loss"]


def required_grad_act_names(cfg):
    pooler = ["pooler"] if cfg["pooler"] == "dense_tanh" else []
    head = (["lm_logits"] if cfg["architecture"] == "decoder"
            else ["pooled"] + pooler + ["logits"])
    return (["input"] + ["layers.%d.output" % i
                         for i in range(cfg["num_layers"])] + head)


# ---------------------------------------------------------------------------
# Optional cross-check against torch.nn.TransformerEncoderLayer
# ---------------------------------------------------------------------------

class Mismatch(Exception):
    """A layer output disagrees with nn.TransformerEncoderLayer's."""


def torch_layer(cfg, P, i, dtype):
    """An nn.TransformerEncoderLayer (eval mode) holding layer i's
    parameters, moved as docs/semantics.md section 12 says (q, k and v are
    packed into in_proj)."""
    activation = cfg["activation"]
    if activation == "gelu_tanh":  # PyTorch takes only relu/gelu by name
        activation = activation_fn(activation)
    layer = torch.nn.TransformerEncoderLayer(
        cfg["d_model"], cfg["num_heads"], cfg["d_ff"], 0.0, activation,
        cfg["layer_norm_eps"], batch_first=True, norm_first=cfg["norm_first"],
        dtype=dtype)
    layer.eval()
    p = "layers.%d." % i
    layer.load_state_dict({
        "self_attn.in_proj_weight": torch.cat(
            [P[p + "attn.%s.weight" % c] for c in "qkv"]),
        "self_attn.in_proj_bias": torch.cat(
            [P[p + "attn.%s.bias" % c] for c in "qkv"]),
        "self_attn.out_proj.weight": P[p + "attn.o.weight"],
        "self_attn.out_proj.bias": P[p + "attn.o.bias"],
        "linear1.weight": P[p + "ffn.fc1.weight"],
        "linear1.bias": P[p + "ffn.fc1.bias"],
        "linear2.weight": P[p + "ffn.fc2.weight"],
        "linear2.bias": P[p + "ffn.fc2.bias"],
        "norm1.weight": P[p + "norm1.weight"],
        "norm1.bias": P[p + "norm1.bias"],
        "norm2.weight": P[p + "norm2.weight"],
        "norm2.bias": P[p + "norm2.bias"],
    })
    return layer


def torch_masks(cfg, lengths, S):
    """PyTorch's src_key_padding_mask (True = padding) and src_mask (True =
    hidden; None unless causal)."""
    pad = torch.arange(S)[None, :] >= lengths[:, None]
    causal = None
    if cfg["causal"]:
        causal = torch.ones(S, S, dtype=torch.bool).triu(diagonal=1)
    return pad, causal


def cross_check(cfg, acts, extra, name):
    """Compares each layer's output with nn.TransformerEncoderLayer (eval).

    Raises Mismatch when a layer differs by more than the bound, which makes
    the run fail (exit 1)."""
    P, lengths, _ = extra
    if cfg["dropout"] != 0 or cfg["activation"] == "gelu_tanh" \
            or cfg["num_layers"] == 0 or has_variants(cfg):
        return
    dtype = acts["input"].dtype
    pad, causal = torch_masks(cfg, lengths, acts["input"].shape[1])
    real = (~pad)[:, :, None]
    tol = 1e-4 if dtype == torch.float32 else 1e-10
    # Grad mode stays on (the layer's parameters require grad), which keeps
    # PyTorch on its math path rather than the nested-tensor fast path.
    for i in range(cfg["num_layers"]):
        layer = torch_layer(cfg, P, i, dtype)
        x = acts["input"] if i == 0 else acts["layers.%d.output" % (i - 1)]
        # Length-0 sequences give NaN in PyTorch; they are left out below.
        ref = layer(x.detach(), src_mask=causal,
                    src_key_padding_mask=pad).detach()
        ours = acts["layers.%d.output" % i].detach()
        keep = real & (lengths > 0)[:, None, None]
        diff = torch.where(keep, (ref - ours).abs(), torch.zeros_like(ref))
        scale = max(1.0, float(ours.abs().max()) if ours.numel() else 1.0)
        err = float(diff.max()) if diff.numel() else 0.0
        if not err <= tol * scale:
            raise Mismatch("%s: layer %d differs from "
                           "nn.TransformerEncoderLayer by %.3g (bound %.3g)"
                           % (name, i, err, tol * scale))


def cross_check_patches(cfg, acts, extra, tensors, name):
    """With input "patches": act.embedding's patch rows against
    F.conv2d(pixels, W, b, stride=P), flattened and transposed (the module
    form of ViT's patch embedding), and its row 0 against cls_token, bit
    for bit. Raises Mismatch beyond the bound."""
    if not is_patches(cfg):
        return
    P = extra[0]
    embedding = acts["embedding"].detach()
    dtype = embedding.dtype
    pixels = torch.from_numpy(tensors["input.pixels"].copy()).to(dtype)
    with torch.no_grad():
        ref = F.conv2d(pixels, P["patch_embedding.weight"].detach(),
                       P["patch_embedding.bias"].detach(),
                       stride=cfg["patch_size"]).flatten(2).transpose(1, 2)
    ours = embedding[:, 1:]
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    scale = max(1.0, float(ref.abs().max()) if ref.numel() else 1.0)
    err = float((ref - ours).abs().max()) if ref.numel() else 0.0
    if tuple(ref.shape) != tuple(ours.shape) or not err <= tol * scale:
        raise Mismatch("%s: act.embedding's patches differ from F.conv2d's by "
                       "%.3g (bound %.3g)" % (name, err, tol * scale))
    cls = P["cls_token"].detach()
    if not bool((embedding[:, 0] == cls).all()):
        raise Mismatch("%s: act.embedding's row 0 is not cls_token" % name)


def out_bias(cfg):
    """Whether the attention's output projection has a bias: attn_out_bias,
    else attn_bias (Qwen2's attention has q, k and v biases only)."""
    return cfg["attn_bias"] if cfg["attn_out_bias"] is None else cfg["attn_out_bias"]


def has_variants(cfg):
    """Whether cfg uses an attention variant nn.TransformerEncoderLayer
    cannot express (it has no GQA, RoPE, ALiBi, window, cap or sink)."""
    return any(cfg[k] != CONFIG_DEFAULTS[k] for k in (
        "num_kv_heads", "sliding_window", "attn_logit_softcap",
        "attn_sinks", "qk_norm", "norm", "ffn", "ffn_bias", "attn_bias", "attn_out_bias",
        "kv_lora_rank")) \
        or cfg["positional"] in ("rope", "alibi") or cfg["activation"] == "silu"


def transformer_layer_outputs(cfg, acts, extra):
    """act.layers.{i}.output from a chain of nn.TransformerEncoderLayer
    modules fed with act.input, in the run's dtype (forward only: the other
    tensors, gradients included, stay the functional graph's).
    variant_problem has ruled out dropout and length-0 sequences."""
    P, lengths, _ = extra
    x = acts["input"].detach()
    pad, causal = torch_masks(cfg, lengths, x.shape[1])
    outputs = {}
    for i in range(cfg["num_layers"]):
        layer = torch_layer(cfg, P, i, x.dtype)
        # Grad mode on, as in cross_check: PyTorch's math path.
        x = layer(x, src_mask=causal, src_key_padding_mask=pad).detach()
        outputs["layers.%d.output" % i] = x
    return outputs


# ---------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------

def to_numpy(t):
    """The tensor's values as a numpy array. numpy has no bfloat16, so a
    bfloat16 tensor comes back as its raw 16-bit patterns (uint16), which
    st_write must be told to declare "BF16"."""
    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def process(path, out_dir, check, variant=AS_GOLDEN):
    """Runs one golden case as `variant` and writes its candidate.

    check: compare the layer outputs with nn.TransformerEncoderLayer, when
    the arithmetic is float32/float64 and there is no mutant (which would
    rightly fail the comparison).
    """
    name = os.path.basename(path)
    cfg, case, tensors, _ = load_case(path)
    try:
        acts, act_grads, param_grads, extra = run_case(cfg, case, tensors,
                                                       variant)
    except RuntimeError as e:
        # torch 1.13 has no CPU float16 kernel for most of this model
        # (addmm, bmm, layer_norm, softmax, gelu, relu, log_softmax).
        if "not implemented for 'Half'" not in str(e):
            raise
        raise Unsupported("torch %s has no CPU float16 kernel: %s"
                          % (torch.__version__, e))
    acts.update(generation_logits(cfg, case, tensors, variant))
    dtype = acts["input"].dtype
    seq2seq = cfg["architecture"] == "encoder_decoder"
    if check and dtype in (torch.float32, torch.float64) \
            and not variant.tf32 and variant.mutant is None:
        if seq2seq:
            cross_check_seq2seq(cfg, acts, extra, name)
        else:
            cross_check(cfg, acts, extra, name)
            cross_check_patches(cfg, acts, extra, tensors, name)
    if variant.transformer_layer:
        acts.update(transformer_layer_outputs(cfg, acts, extra))

    # What the golden holds decides the extra names; the brief's list is
    # always written.
    golden_acts = {k[4:] for k in tensors if k.startswith("act.")}
    golden_gacts = {k[9:] for k in tensors if k.startswith("grad.act.")}
    act_names = [] if seq2seq else required_act_names(cfg)
    act_names += sorted(golden_acts - set(act_names))
    gact_names = [] if seq2seq else required_grad_act_names(cfg)
    gact_names += sorted(golden_gacts - set(gact_names))

    # Every tensor is written in the run's dtype (the golden's by default).
    out, missing = {}, []
    for n in act_names:
        if n in acts:
            out["act." + n] = to_numpy(acts[n])
        else:
            missing.append("act." + n)
    for n in (sorted(param_grads) if seq2seq else param_names(cfg)):
        if n.endswith(".e_score_correction_bias") or quantized(cfg, n):
            continue  # it chooses only, or a quantized weight: no gradient in the contract
        out["grad." + n] = to_numpy(param_grads[n])
    for n in gact_names:
        if n in act_grads:
            out["grad.act." + n] = to_numpy(act_grads[n])
        else:
            missing.append("grad.act." + n)
    for n, arr in out.items():
        ref = tensors.get(n)
        if ref is not None and tuple(ref.shape) != tuple(arr.shape):
            print("warning: %s: %s has shape %s, the golden %s"
                  % (name, n, list(arr.shape), list(ref.shape)))
    for n in missing:
        print("warning: %s: cannot produce %s" % (name, n))

    meta = {"format": "teo-candidate/1",
            "backend": "pytorch %s" % torch.__version__}
    if variant != AS_GOLDEN:
        meta["variant"] = json.dumps(dataclasses.asdict(variant))
    st_dtypes = {n: "BF16" for n, a in out.items() if a.dtype == np.uint16} \
        if dtype == torch.bfloat16 else None
    st_write(os.path.join(out_dir, name), out, meta, st_dtypes)


def golden_files(path):
    if os.path.isdir(path):
        files = sorted(os.path.join(path, f) for f in os.listdir(path)
                       if f.endswith(".safetensors"))
        if not files:
            raise BadInput("no *.safetensors files in %s" % path)
        return files
    if os.path.isfile(path):
        return [path]
    raise BadInput("no such file or directory: %s" % path)


def main(argv=None):
    ap = argparse.ArgumentParser(
        description="Write PyTorch candidates for teo golden files.")
    ap.add_argument("--golden", required=True,
                    help="a golden .safetensors file or a directory of them")
    ap.add_argument("--out", help="directory for the candidate files")
    ap.add_argument("--list-unsupported", action="store_true",
                    help="list the cases this backend cannot express; "
                         "without --out, only list them")
    ap.add_argument("--no-cross-check", action="store_true",
                    help="skip the nn.TransformerEncoderLayer cross-check")
    ap.add_argument("--dtype", choices=sorted(RUN_DTYPES),
                    help="convert the parameters to this dtype, compute in "
                         "it and write every tensor in it (default: the "
                         "golden's dtype)")
    ap.add_argument("--tf32", action="store_true",
                    help="compute in float32 with every GEMM operand "
                         "rounded to tf32, forward and backward")
    ap.add_argument("--mutant", choices=sorted(MUTANTS),
                    help="add one deliberate bug: " + "; ".join(
                        "%s: %s" % item for item in sorted(MUTANTS.items())))
    ap.add_argument("--transformer-layer", action="store_true",
                    help="write act.layers.{i}.output from a chain of "
                         "nn.TransformerEncoderLayer modules")
    args = ap.parse_args(argv)
    if args.tf32 and args.dtype not in (None, "float32"):
        ap.error("--tf32 computes in float32, not %s" % args.dtype)
    if args.transformer_layer and (args.tf32 or args.mutant):
        ap.error("--transformer-layer takes neither --tf32 nor --mutant "
                 "(nn.TransformerEncoderLayer has no way to apply them)")
    variant = Variant(args.dtype, args.tf32, args.mutant,
                      args.transformer_layer)
    torch.set_num_threads(1)

    try:
        files = golden_files(args.golden)
        if args.out is None and not args.list_unsupported:
            raise BadInput("--out DIR is required (or --list-unsupported)")
        if args.out is not None:
            os.makedirs(args.out, exist_ok=True)
        unsupported, failed, done = [], [], 0
        start = time.time()
        for path in files:
            name = os.path.basename(path)
            try:
                if args.out is None:
                    cfg, _, tensors, _ = load_case(path)
                    problem = variant_problem(variant, cfg, tensors)
                    if problem:
                        raise Unsupported(problem)
                else:
                    process(path, args.out, not args.no_cross_check,
                            variant)
                    done += 1
            except Mismatch as e:
                print("mismatch: %s" % e)
                failed.append(name)
            except Unsupported as e:
                print("unsupported: %s: %s" % (name, e))
                unsupported.append((name, str(e)))
            except BadInput as e:
                msg = str(e)
                raise BadInput(msg if name in msg else "%s: %s" % (name, msg))
            except Exception as e:  # a bug here: report it, go on
                print("failed: %s: %s: %s" % (name, type(e).__name__, e))
                failed.append(name)
        if args.list_unsupported:
            print("unsupported cases: %d" % len(unsupported))
            for name, reason in unsupported:
                print("  %s: %s" % (name, reason))
        if args.out is not None:
            print("wrote %d candidate(s) to %s in %.1f s"
                  % (done, args.out, time.time() - start))
        return 1 if failed else 0
    except BadInput as e:
        print("error: %s" % e, file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
