"""Validating a PyTorch backend with teo, under pytest: copy this file and put your own code in
place of `encoder` and `attention`.

1. A small PyTorch encoder is validated against the committed golden corpus (the float64 cases
   without dropout, a ViT's included): its activations and parameter gradients must match.
2. One kernel (attention) is validated against an op case made on the spot with teo.golden.op_case,
   in float64 and in bfloat16 (judged against teo's own bf16 error budget).
3. A deliberately broken attention (no 1/sqrt(Dh) scale) shows the report teo gives.

Run: PYTHONPATH=build/python /usr/bin/python3 -m pytest -s examples/pytorch_backend_test.py
"""

import math
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import teo
import teo.testing

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "golden")


# ---- the backend under test ----------------------------------------------------------------------

def attention(q, k, v, lengths, causal, scale):
    """q, k, v (B, H, S, Dh); keys j >= lengths[b] (and j > i when causal) are masked; a query
    with no visible key gets probability 0 everywhere (teo's rule, where softmax would give NaN)."""
    S = q.shape[2]
    j = torch.arange(S)
    visible = j[None, None, :] < lengths[:, None, None]            # (B, 1, S) over keys
    if causal:
        visible = visible & (j[None, None, :] <= torch.arange(S)[None, :, None])
    visible = visible[:, None]                                      # (B, 1, S, S)
    scores = (q @ k.transpose(-1, -2)) * scale
    any_key = visible.any(-1, keepdim=True)
    probs = torch.softmax(scores.masked_fill(~visible, -math.inf).masked_fill(~any_key, 0), -1)
    probs = torch.where(visible & any_key, probs, torch.zeros_like(probs))
    return scores.masked_fill(~visible, -math.inf), probs, probs @ v


def layer_norm(x, p, name, eps):
    return F.layer_norm(x, x.shape[-1:], p[name + ".weight"], p[name + ".bias"], eps)


def embed(cfg, p, inputs):
    """The embeddings (B, S, D) of tokens (B, S), or for a ViT (input "patches",
    docs/semantics.md section 18.5) of pixels (B, Ch, Img, Img): [CLS], then each patch through
    a Conv2d of kernel and stride patch_size, patch n = py * (Img / P) + px."""
    if cfg.to_dict().get("input") == "patches":
        patches = F.conv2d(inputs, p["patch_embedding.weight"], p["patch_embedding.bias"],
                           stride=cfg.patch_size).flatten(2).transpose(1, 2)
        return torch.cat([p["cls_token"].expand(len(inputs), 1, -1), patches], dim=1)
    return p["embedding.weight"][inputs] * (math.sqrt(cfg.d_model) if cfg.embed_scale else 1.0)


def encoder(cfg, p, inputs, lengths):
    """Forward pass of teo's encoder (docs/semantics.md) for configs without dropout, on tokens
    or (ViT) pixels; returns the named activations the check compares."""
    x = embed(cfg, p, inputs)
    B, S, D = x.shape
    H = cfg.num_heads
    acts = {}
    if cfg.positional == "learned":
        x = x + p["pos_embedding.weight"][:S]
    else:
        pos = torch.arange(S, dtype=torch.float64)[:, None]
        i2 = (torch.arange(D) - torch.arange(D) % 2).double()
        angle = pos / torch.pow(torch.tensor(10000.0, dtype=torch.float64), i2 / D)
        x = x + torch.where(torch.arange(D) % 2 == 0, torch.sin(angle), torch.cos(angle))
    act = {"relu": F.relu, "gelu": F.gelu,
           "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}[cfg.activation]
    eps = cfg.layer_norm_eps
    for i in range(cfg.num_layers):
        n = "layers.%d." % i
        lin = lambda t, m: F.linear(t, p[n + m + ".weight"], p[n + m + ".bias"])  # noqa: E731
        a_in = layer_norm(x, p, n + "norm1", eps) if cfg.norm_first else x
        heads = lambda t: t.reshape(B, S, H, D // H).transpose(1, 2)  # noqa: E731
        _, _, ctx = attention(heads(lin(a_in, "attn.q")), heads(lin(a_in, "attn.k")),
                              heads(lin(a_in, "attn.v")), lengths, cfg.causal,
                              1 / math.sqrt(D // H))
        r1 = x + lin(ctx.transpose(1, 2).reshape(B, S, D), "attn.o")
        f_in = layer_norm(r1, p, n + ("norm2" if cfg.norm_first else "norm1"), eps)
        base = r1 if cfg.norm_first else f_in
        r2 = base + lin(act(lin(f_in, "ffn.fc1")), "ffn.fc2")
        x = r2 if cfg.norm_first else layer_norm(r2, p, n + "norm2", eps)
        acts["act.layers.%d.output" % i] = x
    if cfg.norm_first:
        x = acts["act.final_norm"] = layer_norm(x, p, "final_norm", eps)
    real = (torch.arange(S)[None, :] < lengths[:, None])[:, :, None]
    if cfg.pooling == "mean":
        pooled = torch.where(real, x, 0).sum(1) / lengths.clamp(min=1)[:, None]
    elif cfg.pooling == "cls":
        pooled = x[:, 0]
    else:
        pooled = x.masked_fill(~real, -math.inf).max(1).values
    pooled = torch.where(lengths[:, None] > 0, pooled, torch.zeros_like(pooled))
    acts["act.pooled"] = pooled
    acts["act.logits"] = F.linear(pooled, p["head.weight"], p["head.bias"])
    return acts


# ---- 1. the whole encoder against the corpus ----------------------------------------------------

# The encoder above is the plain layer: the cases of the attention variants (docs/semantics.md,
# section 14), of the block variants, of decoders and of BERT's embeddings and pooler (section 18)
# carry these keys, or a positional kind other than sinusoidal and learned.
VARIANT_KEYS = {"num_kv_heads", "position_offset", "sliding_window", "attn_logit_softcap",
                "attn_sinks", "norm", "ffn", "ffn_bias", "attn_bias", "attn_out_bias", "head_bias", "architecture",
                "type_vocab_size", "embedding_norm", "pooler"}


def corpus_cases():
    for f in sorted(os.listdir(GOLDEN)):
        if f.endswith("_f64.safetensors"):
            g = teo.golden.load(os.path.join(GOLDEN, f))
            keys = g.config.to_dict()
            plain = keys["positional"] in ("sinusoidal", "learned") and not VARIANT_KEYS & set(keys)
            if plain and g.config.dropout == 0 and g.config.label_smoothing == 0:
                yield pytest.param(g, id=f[:-len(".safetensors")])


@pytest.mark.parametrize("g", corpus_cases())
def test_encoder_matches_the_golden_corpus(g):
    p = {n[6:]: torch.tensor(a, requires_grad=True) for n, a in g.tensors.items()
         if n.startswith("param.")}
    batch = g.batch()  # {"tokens", ...}, or a ViT's {"pixels", ...}
    inputs = torch.tensor(batch["pixels"] if "pixels" in batch else batch["tokens"])
    lengths = torch.tensor(batch["lengths"])
    acts = encoder(g.config, p, inputs, lengths)
    labels = torch.tensor(g.tensors["input.labels"])
    loss = F.cross_entropy(acts["act.logits"], labels) if len(labels) else acts["act.logits"].sum()
    loss.backward()
    candidate = {n: t.detach() for n, t in acts.items()}
    candidate["act.loss"] = loss.detach()
    candidate.update({"grad." + n: t.grad for n, t in p.items() if t.grad is not None})
    teo.testing.assert_matches_golden(g, candidate)


# ---- 2. one kernel against an op case ------------------------------------------------------------

SPEC = {"batch": 2, "num_heads": 4, "seq_len": 33, "d_head": 16, "lengths": [33, 20],
        "causal": True, "seed": 3}


def run_attention(case, dtype, kernel=attention):
    t = {n: torch.tensor(a.astype(np.float64)) for n, a in case.tensors.items()
         if n.startswith(("input.q", "input.k", "input.v"))}
    for x in t.values():
        x.data = x.data.to(dtype)
        x.requires_grad_(True)
    scores, probs, ctx = kernel(t["input.q"], t["input.k"], t["input.v"],
                                torch.tensor(case.tensors["input.lengths"]), case.spec["causal"],
                                case.spec["scale"])
    ctx.backward(torch.tensor(case.tensors["grad.output.context"]).to(dtype))
    out = {"output.scores": scores, "output.probs": probs, "output.context": ctx}
    out.update({"grad." + n: x.grad for n, x in t.items()})
    return {n: x.detach().float() if dtype == torch.bfloat16 else x.detach()
            for n, x in out.items()}


def test_attention_kernel_float64():
    case = teo.golden.op_case("attention", dtype="float64", **SPEC)
    teo.testing.assert_matches_golden(case, run_attention(case, torch.float64), require_all=True)


def test_attention_kernel_bfloat16_within_the_budget():
    case = teo.golden.op_case("attention", dtype="float32", **SPEC)
    report = teo.testing.assert_matches_golden(case, run_attention(case, torch.bfloat16),
                                               precision="bf16")
    print("\nbf16 attention: worst fraction of the budget %.3f"
          % max(t.ratio for t in report.tensors))


# ---- 3. what a bug looks like ---------------------------------------------------------------------

def attention_without_scale(q, k, v, lengths, causal, scale):
    return attention(q, k, v, lengths, causal, 1.0)


def test_a_broken_kernel_is_named_at_its_first_divergence():
    case = teo.golden.op_case("attention", dtype="float64", **SPEC)
    with pytest.raises(AssertionError) as failure:
        teo.testing.assert_matches_golden(case, run_attention(case, torch.float64,
                                                               attention_without_scale))
    print("\n" + str(failure.value))
    assert "first divergence: output.scores" in str(failure.value)
