#!/usr/bin/python3
"""PyTorch backend for teo's golden checker.

Reads teo golden files (safetensors, "teo-golden/1"), rebuilds the encoder
in PyTorch from the stored config, inputs, parameters and dropout masks,
runs forward and backward with ordinary torch ops, and writes one candidate
file per golden ("teo-candidate/1") holding every act.* and grad.* tensor.
The candidates are then compared by `teo golden check`.

Usage:
  /usr/bin/python3 tests/interop/torch_backend.py --golden PATH --out DIR
  /usr/bin/python3 tests/interop/torch_backend.py --golden PATH \
      --list-unsupported

PATH is one golden file or a directory of *.safetensors files. The model
follows docs/semantics.md; where teo deliberately differs from PyTorch
(section 12: fully masked attention rows, pooling over zero tokens, the
empty batch) this script follows teo. Exit status: 0 on success, 1 if a
case failed unexpectedly, 2 on bad input.
"""

import argparse
import json
import math
import os
import struct
import sys
import time

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
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"), "U8": np.dtype("u1"), "BOOL": np.dtype("?"),
}
ST_NAMES = {np.dtype("<f8"): "F64", np.dtype("<f4"): "F32",
            np.dtype("<i8"): "I64", np.dtype("u1"): "U8"}


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


def st_write(path, tensors, meta):
    """Writes name -> numpy array (F64/F32/I64/U8) with string metadata."""
    header = {"__metadata__": {str(k): str(v) for k, v in meta.items()}}
    chunks, offset = [], 0
    for name, arr in tensors.items():
        dt = arr.dtype.newbyteorder("<")
        raw = np.ascontiguousarray(arr, dtype=dt).tobytes()
        header[name] = {"dtype": ST_NAMES[dt],
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

CONFIG_DEFAULTS = {
    "vocab_size": 64, "max_len": 32, "d_model": 16, "num_heads": 2,
    "d_ff": 32, "num_layers": 2, "num_classes": 4, "norm_first": False,
    "activation": "gelu", "layer_norm_eps": 1e-5, "positional": "sinusoidal",
    "embed_scale": False, "pooling": "mean", "dropout": 0.0,
    "label_smoothing": 0.0, "causal": False,
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
    if cfg["activation"] not in ("relu", "gelu", "gelu_tanh"):
        raise Unsupported("activation %r" % cfg["activation"])
    if cfg["positional"] not in ("sinusoidal", "learned"):
        raise Unsupported("positional %r" % cfg["positional"])
    if cfg["pooling"] not in ("mean", "cls", "max"):
        raise Unsupported("pooling %r" % cfg["pooling"])
    dtype_name = case.get("dtype")
    if dtype_name not in TORCH_DTYPES:
        raise Unsupported("dtype %r" % dtype_name)
    for key in ("input.tokens", "input.lengths", "input.labels"):
        if key not in tensors:
            raise BadInput("%s: missing tensor %s" % (path, key))
    return cfg, case, tensors, meta


def param_names(cfg):
    names = ["embedding.weight"]
    if cfg["positional"] == "learned":
        names.append("pos_embedding.weight")
    for i in range(cfg["num_layers"]):
        p = "layers.%d." % i
        for proj in ("q", "k", "v", "o"):
            names += [p + "attn.%s.weight" % proj, p + "attn.%s.bias" % proj]
        names += [p + "norm1.weight", p + "norm1.bias",
                  p + "norm2.weight", p + "norm2.bias",
                  p + "ffn.fc1.weight", p + "ffn.fc1.bias",
                  p + "ffn.fc2.weight", p + "ffn.fc2.bias"]
    if cfg["norm_first"]:
        names += ["final_norm.weight", "final_norm.bias"]
    names += ["head.weight", "head.bias"]
    return names


# ---------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------

def sinusoidal_table(seq_len, d_model, dtype):
    """teo's table: angle and sin/cos in double, each entry rounded once."""
    table = np.empty((seq_len, d_model), dtype=np.float64)
    for pos in range(seq_len):
        for c in range(d_model):
            two_i = c - c % 2
            angle = float(pos) / math.pow(10000.0, float(two_i) / d_model)
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
    return lambda x: F.gelu(x, approximate="tanh")


def attention(q, k, v, visible, alpha, drop, site):
    """Scaled dot-product attention with teo's treatment of empty rows.

    visible: bool (B, 1 or H, S, S), True where key j is visible to query i.
    Returns scores (-inf where masked), probs (before dropout), context.
    """
    raw = torch.matmul(q, k.transpose(-1, -2)) * alpha
    scores = raw.masked_fill(~visible, float("-inf"))
    # A row with no visible key: PyTorch's softmax would give NaN. teo
    # defines its probs (and every gradient through it) as exactly 0, so the
    # softmax sees a harmless finite row that is then multiplied out.
    has_key = visible.any(dim=-1, keepdim=True)
    safe = scores.masked_fill(~has_key, 0.0)
    probs = torch.where(has_key, torch.softmax(safe, dim=-1),
                        torch.zeros_like(safe))
    context = torch.matmul(drop(site, probs), v)
    return scores, probs, context


def layer_norm(x, prefix, P, eps):
    return F.layer_norm(x, (x.shape[-1],), P[prefix + ".weight"],
                        P[prefix + ".bias"], eps)


def encoder_layer(x, i, cfg, P, visible, drop, acts):
    B, S, D = x.shape
    H = cfg["num_heads"]
    Dh = D // H
    p = "layers.%d." % i
    eps = cfg["layer_norm_eps"]
    alpha = torch.tensor(1.0 / math.sqrt(Dh), dtype=torch.float64).to(x.dtype)

    def heads(y):
        return y.reshape(B, S, H, Dh).transpose(1, 2)

    if cfg["norm_first"]:
        attn_in = acts[p + "norm1"] = layer_norm(x, p + "norm1", P, eps)
    else:
        attn_in = x
    q = heads(F.linear(attn_in, P[p + "attn.q.weight"], P[p + "attn.q.bias"]))
    k = heads(F.linear(attn_in, P[p + "attn.k.weight"], P[p + "attn.k.bias"]))
    v = heads(F.linear(attn_in, P[p + "attn.v.weight"], P[p + "attn.v.bias"]))
    scores, probs, ctx = attention(q, k, v, visible, alpha, drop,
                                   "dropout." + p + "attn")
    context = ctx.transpose(1, 2).reshape(B, S, D)
    attn_out = F.linear(context, P[p + "attn.o.weight"], P[p + "attn.o.bias"])
    residual1 = x + drop("dropout." + p + "residual1", attn_out)
    acts.update({p + "q": q, p + "k": k, p + "v": v, p + "scores": scores,
                 p + "probs": probs, p + "context": context,
                 p + "attn_out": attn_out, p + "residual1": residual1})

    if cfg["norm_first"]:
        ffn_in = acts[p + "norm2"] = layer_norm(residual1, p + "norm2", P, eps)
        base = residual1
    else:
        ffn_in = acts[p + "norm1"] = layer_norm(residual1, p + "norm1", P, eps)
        base = ffn_in
    ffn_pre = F.linear(ffn_in, P[p + "ffn.fc1.weight"], P[p + "ffn.fc1.bias"])
    ffn_hidden = activation_fn(cfg["activation"])(ffn_pre)
    ffn_out = F.linear(drop("dropout." + p + "ffn", ffn_hidden),
                       P[p + "ffn.fc2.weight"], P[p + "ffn.fc2.bias"])
    residual2 = base + drop("dropout." + p + "residual2", ffn_out)
    if cfg["norm_first"]:
        output = residual2
    else:
        output = acts[p + "norm2"] = layer_norm(residual2, p + "norm2", P, eps)
    acts.update({p + "ffn_pre": ffn_pre, p + "ffn_hidden": ffn_hidden,
                 p + "ffn_out": ffn_out, p + "residual2": residual2,
                 p + "output": output})
    return output


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
    return F.cross_entropy(logits, labels, label_smoothing=smoothing)


def run_case(cfg, case, tensors):
    """Forward + backward.

    Returns (acts, grads of acts, grads of params, extras for the
    cross-check), each a name -> tensor dict in the case dtype.
    """
    dtype = TORCH_DTYPES[case["dtype"]]
    tokens = torch.from_numpy(tensors["input.tokens"].astype(np.int64))
    lengths = torch.from_numpy(tensors["input.lengths"].astype(np.int64))
    labels = torch.from_numpy(tensors["input.labels"].astype(np.int64))
    if tokens.dim() != 2 or lengths.shape != (tokens.shape[0],) \
            or labels.shape != (tokens.shape[0],):
        raise BadInput("inconsistent input shapes")
    B, S = tokens.shape
    D, H = cfg["d_model"], cfg["num_heads"]

    P = {}
    for name in param_names(cfg):
        key = "param." + name
        if key not in tensors:
            raise BadInput("missing tensor %s" % key)
        t = torch.from_numpy(tensors[key].copy())
        if t.dtype != dtype:
            raise BadInput("%s is %s, expected %s" % (key, t.dtype, dtype))
        P[name] = t.requires_grad_(True)
    extra = sorted(k for k in tensors if k.startswith("param.")
                   and k[len("param."):] not in P)
    if extra:
        raise BadInput("unexpected parameter %s" % extra[0])

    masks = {k: torch.from_numpy(v != 0) for k, v in tensors.items()
             if k.startswith("dropout.")}
    drop = Dropout(masks, cfg["dropout"], dtype)

    acts = {}
    scale = torch.tensor(math.sqrt(D) if cfg["embed_scale"] else 1.0,
                         dtype=torch.float64).to(dtype)
    embedding = F.embedding(tokens, P["embedding.weight"]) * scale
    if cfg["positional"] == "learned":
        positional = P["pos_embedding.weight"][:S]
    else:
        positional = sinusoidal_table(S, D, dtype).requires_grad_(True)
    x = drop("dropout.input", embedding + positional)
    acts.update({"embedding": embedding, "positional": positional,
                 "input": x})

    # visible[b, 0, i, j]: key j is a real token, and (causal) j <= i.
    j = torch.arange(S)
    visible = j[None, None, :] < lengths[:, None, None]           # (B, 1, S)
    visible = visible.expand(B, S, S)
    if cfg["causal"]:
        visible = visible & (j[None, :, None] >= j[None, None, :])
    visible = visible[:, None, :, :]  # (B, 1, S, S)

    for i in range(cfg["num_layers"]):
        x = encoder_layer(x, i, cfg, P, visible, drop, acts)
    if cfg["norm_first"]:
        x = acts["final_norm"] = layer_norm(x, "final_norm", P,
                                           cfg["layer_norm_eps"])
    pooled = acts["pooled"] = pool(x, lengths, cfg["pooling"])
    logits = acts["logits"] = F.linear(pooled, P["head.weight"],
                                       P["head.bias"])
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


def required_act_names(cfg):
    names = ["embedding", "positional", "input"]
    for i in range(cfg["num_layers"]):
        p = "layers.%d." % i
        names += [p + n for n in (
            "norm1", "q", "k", "v", "scores", "probs", "context", "attn_out",
            "residual1", "norm2", "ffn_hidden", "ffn_out", "output")]
    if cfg["norm_first"]:
        names.append("final_norm")
    return names + ["pooled", "logits", "loss"]


def required_grad_act_names(cfg):
    return (["input"] + ["layers.%d.output" % i
                         for i in range(cfg["num_layers"])]
            + ["pooled", "logits"])


# ---------------------------------------------------------------------------
# Optional cross-check against torch.nn.TransformerEncoderLayer
# ---------------------------------------------------------------------------

class Mismatch(Exception):
    """This backend's layer output disagrees with nn.TransformerEncoderLayer."""


def cross_check(cfg, acts, extra, name):
    """Compares each layer's output with nn.TransformerEncoderLayer (eval).

    Raises Mismatch when a layer differs by more than the bound, which makes
    the run fail (exit 1)."""
    P, lengths, _ = extra
    if cfg["dropout"] != 0 or cfg["activation"] == "gelu_tanh" \
            or cfg["num_layers"] == 0:
        return
    dtype = acts["input"].dtype
    D, S = cfg["d_model"], acts["input"].shape[1]
    layer = torch.nn.TransformerEncoderLayer(
        D, cfg["num_heads"], cfg["d_ff"], 0.0, cfg["activation"],
        cfg["layer_norm_eps"], batch_first=True, norm_first=cfg["norm_first"],
        dtype=dtype)
    layer.eval()
    pad = torch.arange(S)[None, :] >= lengths[:, None]
    causal = None
    if cfg["causal"]:
        causal = torch.ones(S, S, dtype=torch.bool).triu(diagonal=1)
    real = (~pad)[:, :, None]
    tol = 1e-4 if dtype == torch.float32 else 1e-10
    # Grad mode stays on (the layer's parameters require grad), which keeps
    # PyTorch on its math path rather than the nested-tensor fast path.
    for i in range(cfg["num_layers"]):
        p = "layers.%d." % i
        sd = {
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
        }
        layer.load_state_dict(sd)
        x = acts["input"] if i == 0 else acts["layers.%d.output" % (i - 1)]
        # Length-0 sequences give NaN in PyTorch; they are left out below.
        ref = layer(x.detach(), src_mask=causal,
                    src_key_padding_mask=pad).detach()
        ours = acts[p + "output"].detach()
        keep = real & (lengths > 0)[:, None, None]
        diff = torch.where(keep, (ref - ours).abs(), torch.zeros_like(ref))
        scale = max(1.0, float(ours.abs().max()) if ours.numel() else 1.0)
        err = float(diff.max()) if diff.numel() else 0.0
        if not err <= tol * scale:
            raise Mismatch("%s: layer %d differs from nn.TransformerEncoderLayer "
                           "by %.3g (bound %.3g)" % (name, i, err, tol * scale))


# ---------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------

def to_numpy(t, np_dtype):
    return t.detach().contiguous().numpy().astype(np_dtype, copy=False)


def process(path, out_dir, check):
    cfg, case, tensors, _ = load_case(path)
    acts, act_grads, param_grads, extra = run_case(cfg, case, tensors)
    np_dtype = np.float32 if case["dtype"] == "float32" else np.float64

    # What the golden holds decides the extra names; the brief's list is
    # always written.
    golden_acts = {k[4:] for k in tensors if k.startswith("act.")}
    golden_gacts = {k[9:] for k in tensors if k.startswith("grad.act.")}
    act_names = required_act_names(cfg)
    act_names += sorted(golden_acts - set(act_names))
    gact_names = required_grad_act_names(cfg)
    gact_names += sorted(golden_gacts - set(gact_names))

    out, missing = {}, []
    for n in act_names:
        if n in acts:
            out["act." + n] = to_numpy(acts[n], np_dtype)
        else:
            missing.append("act." + n)
    for n in param_names(cfg):
        out["grad." + n] = to_numpy(param_grads[n], np_dtype)
    for n in gact_names:
        if n in act_grads:
            out["grad.act." + n] = to_numpy(act_grads[n], np_dtype)
        else:
            missing.append("grad.act." + n)
    for name, arr in out.items():
        ref = tensors.get(name)
        if ref is not None and tuple(ref.shape) != tuple(arr.shape):
            print("warning: %s: %s has shape %s, the golden %s"
                  % (os.path.basename(path), name, list(arr.shape),
                     list(ref.shape)))
        if ref is not None and ref.dtype != arr.dtype:
            out[name] = arr.astype(ref.dtype)
    for name in missing:
        print("warning: %s: cannot produce %s"
              % (os.path.basename(path), name))

    if check:
        cross_check(cfg, acts, extra, os.path.basename(path))
    meta = {"format": "teo-candidate/1",
            "backend": "pytorch %s" % torch.__version__}
    st_write(os.path.join(out_dir, os.path.basename(path)), out, meta)


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
    args = ap.parse_args(argv)
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
                    load_case(path)
                else:
                    process(path, args.out, not args.no_cross_check)
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
