"""A whole-encoder candidate from a plain torch.nn.TransformerEncoder, dropout included.

The steps a backend author takes to check a whole model against a golden with dropout:

1. Build nn.TransformerEncoder from nn.TransformerEncoderLayer(batch_first=True) with the golden's
   config, and copy the golden's parameters into it (docs/semantics.md section 12: q, k and v
   weights are packed into in_proj_weight; attn.o is out_proj, ffn.fc1 and ffn.fc2 are linear1
   and linear2).
2. Replay the golden's dropout masks. While the model runs, torch.nn.functional.dropout is
   replaced by a function that takes the next stored mask instead of drawing one:
   out = mask ? x * 1/(1 - p) : 0. PyTorch calls it in teo's order (docs/golden-format.md,
   "Dropout masks"): dropout.input on the embedding sum, then per layer attn (the attention
   probabilities, inside self_attn), residual1 (dropout1), ffn (between linear1 and linear2) and
   residual2 (dropout2).
3. Embedding, positions, pooling, head and loss are plain torch code around the encoder.
4. Backward from the mean loss. The candidate (layer outputs, pooled, logits, loss, their
   gradients and every parameter's gradient) is written with teo.golden.save and judged with
   teo.golden.check.

Run:  PYTHONPATH=build/python .venv/bin/python examples/whole_encoder_candidate.py [CASE [OUT]]
  or  PYTHONPATH=build/python .venv/bin/python -m pytest -s examples/whole_encoder_candidate.py
"""

import contextlib
import math
import os
import sys
import tempfile

import torch
import torch.nn.functional as F
from torch import nn

import teo

HERE = os.path.dirname(os.path.abspath(__file__))
GOLDEN = os.path.normpath(os.path.join(HERE, "..", "golden"))
# Two float64 cases with dropout: post-norm with exact GELU and mean pooling, and pre-norm (with
# the final norm) with tanh GELU and max pooling.
CASES = ["dropout_post_f64", "dropout_pre_tanh_max_f64"]


# ---- 1. the model -------------------------------------------------------------------------------

def torch_names(cfg):
    """teo's parameter name -> (the nn.TransformerEncoder parameter holding it, its rows)."""
    D = cfg.d_model
    names = {}
    for i in range(cfg.num_layers):
        t = "layers.%d." % i  # the same prefix in both models
        for j, c in enumerate("qkv"):
            rows = slice(j * D, (j + 1) * D)
            names[t + "attn.%s.weight" % c] = (t + "self_attn.in_proj_weight", rows)
            names[t + "attn.%s.bias" % c] = (t + "self_attn.in_proj_bias", rows)
        for ours, theirs in (("attn.o", "self_attn.out_proj"), ("ffn.fc1", "linear1"),
                             ("ffn.fc2", "linear2"), ("norm1", "norm1"), ("norm2", "norm2")):
            for w in ("weight", "bias"):
                names[t + ours + "." + w] = (t + theirs + "." + w, slice(None))
    if cfg.norm_first:  # pre-norm: the encoder's own final norm
        for w in ("weight", "bias"):
            names["final_norm." + w] = ("norm." + w, slice(None))
    return names


def transformer_encoder(cfg, params):
    """nn.TransformerEncoder with the config's layers, holding the golden's parameters."""
    # the config keys of the attention variants (docs/semantics.md section 14), when in use
    variants = set(cfg.to_dict()) - set(teo.ModelConfig().to_dict())
    assert not variants, "nn.TransformerEncoderLayer has no %s" % sorted(variants)
    activation = {"relu": "relu", "gelu": "gelu",
                  "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}[cfg.activation]
    layer = nn.TransformerEncoderLayer(cfg.d_model, cfg.num_heads, cfg.d_ff, cfg.dropout,
                                       activation, cfg.layer_norm_eps, batch_first=True,
                                       norm_first=cfg.norm_first, dtype=torch.float64)
    final_norm = (nn.LayerNorm(cfg.d_model, cfg.layer_norm_eps, dtype=torch.float64)
                  if cfg.norm_first else None)
    encoder = nn.TransformerEncoder(layer, cfg.num_layers, norm=final_norm,
                                    enable_nested_tensor=False)
    for layer in encoder.layers:
        explicit_attention_weights(layer.self_attn)
    theirs = dict(encoder.named_parameters())
    with torch.no_grad():
        for ours, (name, rows) in torch_names(cfg).items():
            theirs[name][rows].copy_(torch.from_numpy(params[ours]))
    return encoder.train()  # train mode: dropout runs (replayed below)


def explicit_attention_weights(attn):
    """Makes the layer's nn.MultiheadAttention compute its probabilities explicitly, so that
    their dropout goes through F.dropout (replayed below). The layer asks for need_weights=False,
    which in PyTorch 2 runs a fused scaled_dot_product_attention that draws its own mask."""
    forward = attn.forward

    def with_weights(*args, **kwargs):
        kwargs["need_weights"] = True
        kwargs["average_attn_weights"] = False
        return forward(*args, **kwargs)

    attn.forward = with_weights


def sinusoidal(S, D):
    """teo's positional table (docs/semantics.md section 8.2)."""
    pos = torch.arange(S, dtype=torch.float64)[:, None]
    i2 = (torch.arange(D) - torch.arange(D) % 2).double()
    angle = pos / torch.pow(torch.tensor(10000.0, dtype=torch.float64), i2 / D)
    return torch.where(torch.arange(D) % 2 == 0, torch.sin(angle), torch.cos(angle))


def forward(cfg, params, encoder, tokens, lengths, labels):
    """The whole model around the encoder. Returns the loss, the activations by their golden
    names (their gradients retained), and the parameters outside the encoder by teo's names."""
    B, S = tokens.shape
    D = cfg.d_model
    emb = torch.tensor(params["embedding.weight"], requires_grad=True)
    head_w = torch.tensor(params["head.weight"], requires_grad=True)
    head_b = torch.tensor(params["head.bias"], requires_grad=True)
    leaves = {"embedding.weight": emb, "head.weight": head_w, "head.bias": head_b}
    x = F.embedding(tokens, emb) * (math.sqrt(D) if cfg.embed_scale else 1.0)
    if cfg.positional == "learned":
        pos = leaves["pos_embedding.weight"] = torch.tensor(params["pos_embedding.weight"],
                                                            requires_grad=True)
        x = x + pos[:S]
    else:
        assert cfg.positional == "sinusoidal", "nn.TransformerEncoder has no " + cfg.positional
        x = x + sinusoidal(S, D)
    x = nn.Dropout(cfg.dropout)(x)  # dropout.input

    # The layer outputs, kept (with their gradients) by a hook on each layer.
    acts = {"act.input": x}
    hooks = [layer.register_forward_hook(
        lambda module, args, out, i=i: acts.__setitem__("act.layers.%d.output" % i, out))
        for i, layer in enumerate(encoder.layers)]
    padding = torch.arange(S)[None, :] >= lengths[:, None]  # True: key j is padding
    causal = torch.ones(S, S, dtype=torch.bool).triu(1) if cfg.causal else None
    x = encoder(x, mask=causal, src_key_padding_mask=padding)
    for h in hooks:
        h.remove()
    if cfg.norm_first:
        acts["act.final_norm"] = x

    real = ~padding[:, :, None]
    if cfg.pooling == "mean":
        pooled = torch.where(real, x, 0).sum(1) / lengths[:, None]
    elif cfg.pooling == "cls":
        pooled = x[:, 0]
    else:
        pooled = x.masked_fill(~real, -math.inf).max(1).values
    logits = F.linear(pooled, head_w, head_b)
    loss = F.cross_entropy(logits, labels, label_smoothing=cfg.label_smoothing)
    acts.update({"act.pooled": pooled, "act.logits": logits, "act.loss": loss})
    for t in acts.values():
        t.retain_grad()
    return loss, acts, leaves


# ---- 2. dropout, replayed -----------------------------------------------------------------------

def dropout_sites(cfg):
    """teo's dropout sites in the order the model applies them."""
    sites = ["dropout.input"]
    for i in range(cfg.num_layers):
        sites += ["dropout.layers.%d.%s" % (i, s)
                  for s in ("attn", "residual1", "ffn", "residual2")]
    return sites


@contextlib.contextmanager
def replayed_dropout(masks, sites, p):
    """Replaces torch.nn.functional.dropout, for the duration, by one that applies masks[site]
    for the next of sites, in order, instead of drawing a mask: mask ? x * 1/(1 - p) : 0."""
    queue = list(sites)
    scale = 1.0 / (1.0 - p)  # teo's Real(1 / (1 - p)): in double, rounded once

    def dropout(x, p=0.5, training=True, inplace=False):
        if not training:
            return x
        assert queue, "dropout applied more often than the golden has masks"
        site = queue.pop(0)
        mask = torch.from_numpy(masks[site]).bool()
        # The attention probabilities come as (B*H, S, S), the others in their own shape.
        assert mask.numel() == x.numel(), "%s: mask %s for a tensor of shape %s" % (
            site, tuple(mask.shape), tuple(x.shape))
        return torch.where(mask.reshape(x.shape), x * scale, torch.zeros_like(x))

    original = F.dropout
    F.dropout = dropout  # nn.Dropout and multi_head_attention_forward look it up at each call
    try:
        yield queue
    finally:
        F.dropout = original
    assert not queue, "masks left unused: %s" % queue


# ---- 3. the candidate, written and checked ------------------------------------------------------

def candidate_of(golden, sites=None):
    """Runs the PyTorch model on the golden's inputs, with its masks (in the order of sites),
    and returns the candidate: name -> torch tensor."""
    cfg, params, batch = golden.config, golden.params(), golden.batch()
    tokens, lengths, labels = (torch.from_numpy(batch[k])
                               for k in ("tokens", "lengths", "labels"))
    assert bool((lengths > 0).all()), \
        "nn.TransformerEncoderLayer gives NaN for a length-0 sequence (teo gives 0)"
    encoder = transformer_encoder(cfg, params)
    with replayed_dropout(golden.masks(), sites or dropout_sites(cfg), cfg.dropout):
        loss, acts, leaves = forward(cfg, params, encoder, tokens, lengths, labels)
    loss.backward()

    candidate = dict(acts)
    # the golden holds the gradients of act.input, the layer outputs, pooled and logits
    candidate.update({"grad." + n: t.grad for n, t in acts.items()
                      if n not in ("act.final_norm", "act.loss")})
    candidate.update({"grad." + n: t.grad for n, t in leaves.items()})
    theirs = dict(encoder.named_parameters())
    for ours, (name, rows) in torch_names(cfg).items():
        candidate["grad." + ours] = theirs[name].grad[rows]
    return candidate


def check_case(case, out_dir):
    """Writes the candidate of golden/<case>.safetensors to out_dir and checks it."""
    golden_path = os.path.join(GOLDEN, case + ".safetensors")
    golden = teo.golden.load(golden_path)
    candidate = candidate_of(golden)
    path = os.path.join(out_dir, case + ".safetensors")
    teo.golden.save(path, candidate, force=True)  # torch tensors, requires_grad or not
    report = teo.golden.check(golden_path, path)
    return report, candidate


def test_whole_encoder_candidate(tmp_path):
    for case in CASES:
        report, candidate = check_case(case, str(tmp_path))
        print("\n%s\n%r" % (report, report))
        assert report.passed, str(report)
        # every tensor written was compared, and passed
        assert report.counts["passed"] == len(candidate) and report.counts["failed"] == 0


def test_masks_in_the_wrong_order_fail_at_the_first_layer(tmp_path):
    golden = teo.golden.load(os.path.join(GOLDEN, CASES[0] + ".safetensors"))
    sites = dropout_sites(golden.config)
    sites[2], sites[4] = sites[4], sites[2]  # layer 0's residual1 and residual2 swapped
    report = teo.golden.check(golden, candidate_of(golden, sites))
    assert not report.passed and report.first_divergence == "layers.0.output", str(report)


if __name__ == "__main__":
    cases = sys.argv[1:2] or CASES
    out = sys.argv[2] if len(sys.argv) > 2 else os.path.join(tempfile.gettempdir(),
                                                             "teo-whole-encoder")
    for case in cases:
        report, _ = check_case(case, out)
        print(report)
        print(repr(report))
        assert report.passed, "the candidate of %s does not pass" % case
    print("candidates in %s" % out)
