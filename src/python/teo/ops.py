"""Single operators, forward and exact backward, through the model's own layer code.

Each function takes the op's inputs as arrays (float64 or float32; the result has the inputs'
dtype's arithmetic, returned as float64 arrays) and its options as keywords spelled as in an op
spec (docs/golden-format.md, "Op cases"), and returns {"output.*": ..., "grad.input.*": ...,
"grad.param.*": ...}. Upstream gradients are the grad_* keywords; each defaults to ones.
"""

import numpy as np

from . import _teo
from ._wire import wire_of


def _call(op, spec, inputs, upstream, precision=None, backend=None, threads=None):
    from . import ConfigError
    arrays = {}
    dtypes = set()
    for name, a in inputs.items():
        if a is None:
            continue
        a = np.asarray(a)
        arrays[name] = a
        if a.dtype.kind == "f":
            dtypes.add(str(a.dtype))
    if len(dtypes) > 1:
        raise ConfigError("the float inputs of %s mix %s" % (op, sorted(dtypes)))
    dtype = dtypes.pop() if dtypes else "float64"
    if dtype not in ("float32", "float64"):
        raise ConfigError("the inputs of %s are %s; teo.ops takes float32 or float64" % (op, dtype))
    spec = dict(spec, dtype=dtype, seed=0)
    contract = _teo.op_contract(op, spec)
    for name, shape, optional in contract:
        if optional or not name.startswith("output."):
            continue
        g = upstream.get(name)
        arrays["grad." + name] = (np.ones(shape, dtype=dtype) if g is None
                                  else np.asarray(g))
    if precision is None and dtype == "float32":
        precision = "fp32"
    return _teo.run_op(op, spec, wire_of(arrays), precision, backend, threads)


def _rows(x):
    x = np.asarray(x)
    if x.ndim != 2:
        from . import ShapeError
        raise ShapeError("x must be (rows, cols), got shape %s" % (x.shape,))
    return x.shape


def linear(x, weight, bias=None, *, grad_y=None, **kw):
    n, i = _rows(x)
    o = np.asarray(weight).shape[0]
    return _call("linear", {"rows": n, "in_features": i, "out_features": o,
                            "bias": bias is not None},
                 {"input.x": x, "param.weight": weight, "param.bias": bias},
                 {"output.y": grad_y}, **kw)


def layer_norm(x, weight, bias, *, layer_norm_eps=1e-5, grad_y=None, **kw):
    n, d = _rows(x)
    return _call("layer_norm", {"rows": n, "d_model": d, "layer_norm_eps": layer_norm_eps},
                 {"input.x": x, "param.weight": weight, "param.bias": bias},
                 {"output.y": grad_y}, **kw)


def softmax(x, *, visible=None, grad_y=None, **kw):
    n, c = _rows(x)
    spec = {"rows": n, "cols": c}
    if visible is not None:
        spec["visible"] = [int(v) for v in visible]
    return _call("softmax", spec, {"input.x": x}, {"output.y": grad_y}, **kw)


def activation(x, *, activation="gelu", grad_y=None, **kw):
    n, c = _rows(x)
    return _call("activation", {"rows": n, "cols": c, "activation": activation},
                 {"input.x": x}, {"output.y": grad_y}, **kw)


def dropout(x, mask, *, dropout, grad_y=None, **kw):
    n, c = _rows(x)
    return _call("dropout", {"rows": n, "cols": c, "dropout": dropout},
                 {"input.x": x, "input.mask": np.asarray(mask).astype(np.uint8)},
                 {"output.y": grad_y}, **kw)


# The attention variants' spec keys (docs/semantics.md section 14), passed through as given.
ATTENTION_VARIANT_KEYS = ("positional", "rope_style", "rotary_dim", "rope_base", "rope_scaling",
                          "alibi_max_bias", "position_offset", "sliding_window",
                          "attn_logit_softcap")


def attention(q, k, v, lengths=None, *, causal=False, scale=None, probs=None, sinks=None,
              grad_context=None, **kw):
    """k and v may have fewer heads than q (grouped-query attention); sinks (H) adds a learned
    sink logit per head; the other variants are keywords: positional ("none", "rope", "alibi"),
    rope_style, rotary_dim, rope_base, rope_scaling, alibi_max_bias, position_offset,
    sliding_window, attn_logit_softcap."""
    b, h, s, dh = np.asarray(q).shape
    lengths = [s] * b if lengths is None else [int(x) for x in lengths]
    spec = {"batch": b, "num_heads": h, "seq_len": s, "d_head": dh, "lengths": lengths,
            "causal": causal}
    kv_heads = np.asarray(k).shape[1] if np.asarray(k).ndim == 4 else h
    if kv_heads != h:
        spec["num_kv_heads"] = int(kv_heads)
    for key in ATTENTION_VARIANT_KEYS:
        if key in kw:
            spec[key] = kw.pop(key)
    if sinks is not None:
        spec["attn_sinks"] = True
    if scale is not None:
        spec["scale"] = scale
    if probs is not None:
        spec["probs"] = probs
    return _call("attention", spec,
                 {"input.q": q, "input.k": k, "input.v": v,
                  "input.lengths": np.asarray(lengths, dtype=np.int64), "param.sinks": sinks},
                 {"output.context": grad_context}, **kw)


def embedding(tokens, weight, pos_weight=None, *, positional="sinusoidal", embed_scale=False,
              grad_x=None, **kw):
    b, s = np.asarray(tokens).shape
    v, d = np.asarray(weight).shape
    spec = {"batch": b, "seq_len": s, "vocab_size": v, "d_model": d, "positional": positional,
            "embed_scale": embed_scale}
    if positional == "learned":
        spec["max_len"] = int(np.asarray(pos_weight).shape[0])
    return _call("embedding", spec,
                 {"input.tokens": np.asarray(tokens, dtype=np.int64), "param.weight": weight,
                  "param.pos_weight": pos_weight},
                 {"output.x": grad_x}, **kw)


def pooling(x, lengths, *, pooling="mean", grad_pooled=None, **kw):
    b, s, d = np.asarray(x).shape
    lengths = [int(v) for v in lengths]
    return _call("pooling", {"batch": b, "seq_len": s, "d_model": d, "lengths": lengths,
                             "pooling": pooling},
                 {"input.x": x, "input.lengths": np.asarray(lengths, dtype=np.int64)},
                 {"output.pooled": grad_pooled}, **kw)


def cross_entropy(logits, labels, *, label_smoothing=0.0, grad_loss=None, **kw):
    n, c = _rows(logits)
    return _call("cross_entropy", {"batch": n, "num_classes": c,
                                   "label_smoothing": label_smoothing},
                 {"input.logits": logits, "input.labels": np.asarray(labels, dtype=np.int64)},
                 {"output.loss": grad_loss}, **kw)


def encoder_layer(x, lengths, params, *, masks=None, grad_y=None, **options):
    """One encoder layer: params by the model's names without "layers.{i}." ("attn.q.weight",
    ...); options: num_heads, d_ff, activation, norm_first, causal, layer_norm_eps, dropout, and
    the attention variants' config keys (num_kv_heads, positional, ..., attn_sinks).
    With dropout, masks {"attn", "residual1", "ffn", "residual2"} must be the ones the seed 0
    draws (teo.golden.op_case gives them)."""
    b, s, d = np.asarray(x).shape
    lengths = [int(v) for v in lengths]
    run_kw = {k: options.pop(k) for k in ("precision", "backend", "threads") if k in options}
    spec = dict(options, batch=b, seq_len=s, lengths=lengths, d_model=d)
    inputs = {"input.x": x, "input.lengths": np.asarray(lengths, dtype=np.int64)}
    for n, a in (masks or {}).items():
        inputs["input.mask." + n] = np.asarray(a).astype(np.uint8)
    for n, a in params.items():
        inputs["param." + n] = a
    return _call("encoder_layer", spec, inputs, {"output.y": grad_y}, **run_kw)
