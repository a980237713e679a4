"""Single operators, forward and exact backward, through the model's own layer code.

Each function takes the op's inputs as arrays (numpy arrays or torch tensors, float64 or float32;
the result has the inputs' dtype's arithmetic, returned as float64 arrays) and its options as
keywords spelled as in an op spec (docs/golden-format.md, "Op cases"), and returns
{"output.*": ..., "grad.input.*": ..., "grad.param.*": ...}. Upstream gradients are the grad_*
keywords; each defaults to ones. precision=, backend= and threads= work as in teo.run. A keyword
a function does not take is a TypeError naming the closest one it does.
"""

import functools
import inspect

import numpy as np

from . import _teo
from ._wire import as_array, backend_of, check_keywords, json_value, real_array, wire_of

# The keywords of every op: how it runs (as in teo.run).
RUN_KEYS = ("precision", "backend", "threads")


def _public(*extra):
    """Makes a keyword the op does not take (its own, extra, or RUN_KEYS) a TypeError naming
    teo.ops.<op>() and the closest keyword it takes."""
    def wrap(fn):
        own = [p.name for p in inspect.signature(fn).parameters.values()
               if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        valid = own + [k for k in extra if k not in own] + list(RUN_KEYS)

        @functools.wraps(fn)
        def checked(*args, **kw):
            check_keywords("teo.ops." + fn.__name__, kw, valid)
            return fn(*args, **kw)
        return checked
    return wrap


def _call(op, spec, inputs, upstream, precision=None, backend=None, threads=None):
    from . import ConfigError
    what = "teo.ops." + op
    arrays = {}
    dtypes = set()
    for name, a in inputs.items():
        if a is None:
            continue
        a = real_array(a, name, what)
        arrays[name] = a
        if a.dtype.kind == "f":
            dtypes.add(str(a.dtype))
    if len(dtypes) > 1:
        raise ConfigError("the float inputs of %s mix %s" % (op, sorted(dtypes)))
    dtype = dtypes.pop() if dtypes else "float64"
    if dtype not in ("float32", "float64"):
        raise ConfigError("the inputs of %s are %s; teo.ops takes float32 or float64" % (op, dtype))
    spec = json_value(dict(spec, dtype=dtype, seed=0))
    contract = _teo.op_contract(op, spec)
    backward = any(name.startswith("grad.") for name, _, _ in contract)  # else forward only
    for name, shape, no_upstream in contract:
        if no_upstream or not backward or not name.startswith("output."):
            continue
        g = upstream.get(name)
        arrays["grad." + name] = (np.ones(shape, dtype=dtype) if g is None
                                  else real_array(g, "grad_" + name[len("output."):], what))
    if precision is None and dtype == "float32":
        precision = "fp32"
    from . import FormatError, ShapeError
    try:
        return _teo.run_op(op, spec, wire_of(arrays), precision, backend_of(backend), threads)
    except FormatError as e:
        # arrays that do not fit together: the op case built from them names the tensor
        raise ShapeError("%s: %s" % (what, str(e).replace("the op case's ", ""))) from None


def _rows(x):
    if x.ndim != 2:
        from . import ShapeError
        raise ShapeError("x must be (rows, cols), got shape %s" % (x.shape,))
    return x.shape


def _real(a, name, op):
    """The float input `name` of op as an array (bfloat16 and float16 are a ConfigError)."""
    return real_array(a, name, "teo.ops." + op)


def _ints(v, name, op):
    """A list of Python ints from a list, array or tensor of integers; ConfigError naming the
    argument for anything else (a float is not truncated)."""
    a = as_array(v)
    if a.size and a.dtype.kind not in "iu":
        from . import ConfigError
        raise ConfigError("teo.ops.%s: %s must hold integers, got %s" % (op, name, a.dtype))
    return [int(x) for x in a.reshape(-1)]


def _int_array(v, name, op):
    """An integer array (of any shape) as int64; ConfigError naming the argument for floats."""
    a = as_array(v)
    if a.size and a.dtype.kind not in "iu":
        from . import ConfigError
        raise ConfigError("teo.ops.%s: %s must hold integers, got %s" % (op, name, a.dtype))
    return a.astype(np.int64)


def _dims(a, n, layout, name, op):
    """a's shape when it has n dimensions; ShapeError naming the argument and its layout
    otherwise."""
    if a.ndim != n:
        from . import ShapeError
        raise ShapeError("teo.ops.%s: %s must be %s, got shape %s" % (op, name, layout, a.shape))
    return a.shape


@_public()
def linear(x, weight, bias=None, *, grad_y=None, **kw):
    x, weight = _real(x, "x", "linear"), _real(weight, "weight", "linear")
    n, i = _rows(x)
    o = weight.shape[0]
    return _call("linear", {"rows": n, "in_features": i, "out_features": o,
                            "bias": bias is not None},
                 {"input.x": x, "param.weight": weight, "param.bias": bias},
                 {"output.y": grad_y}, **kw)


@_public()
def layer_norm(x, weight, bias, *, layer_norm_eps=1e-5, grad_y=None, **kw):
    x = _real(x, "x", "layer_norm")
    n, d = _rows(x)
    return _call("layer_norm", {"rows": n, "d_model": d, "layer_norm_eps": layer_norm_eps},
                 {"input.x": x, "param.weight": weight, "param.bias": bias},
                 {"output.y": grad_y}, **kw)


@_public()
def rms_norm(x, weight, *, layer_norm_eps=1e-5, grad_y=None, **kw):
    """RMSNorm over the last dimension: x / sqrt(mean(x^2) + eps) * weight (no bias)."""
    x = _real(x, "x", "rms_norm")
    n, d = _rows(x)
    return _call("rms_norm", {"rows": n, "d_model": d, "layer_norm_eps": layer_norm_eps},
                 {"input.x": x, "param.weight": weight}, {"output.y": grad_y}, **kw)


@_public()
def softmax(x, *, visible=None, grad_y=None, **kw):
    x = _real(x, "x", "softmax")
    n, c = _rows(x)
    spec = {"rows": n, "cols": c}
    if visible is not None:
        spec["visible"] = _ints(visible, "visible", "softmax")
    return _call("softmax", spec, {"input.x": x}, {"output.y": grad_y}, **kw)


@_public()
def activation(x, *, activation="gelu", grad_y=None, **kw):
    x = _real(x, "x", "activation")
    n, c = _rows(x)
    return _call("activation", {"rows": n, "cols": c, "activation": activation},
                 {"input.x": x}, {"output.y": grad_y}, **kw)


@_public()
def ffn(x, fc1_weight, fc2_weight, *, gate_weight=None, fc1_bias=None, fc2_bias=None,
        gate_bias=None, ffn="mlp", activation="gelu", grad_y=None, **kw):
    """The feed-forward network: fc2(act(fc1(x))) (ffn "mlp"), or gated, fc2(act(gate(x)) *
    fc1(x)) with act silu ("swiglu") or gelu ("geglu"). The biases are all given or all left out;
    gate_weight (and gate_bias) only for a gated FFN."""
    from . import ConfigError
    x = _real(x, "x", "ffn")
    n, d = _rows(x)
    w1 = _dims(_real(fc1_weight, "fc1_weight", "ffn"), 2, "(d_ff, d_model)", "fc1_weight", "ffn")
    gated = ffn in ("swiglu", "geglu")
    if gated != (gate_weight is not None):
        raise ConfigError("teo.ops.ffn: ffn=%r %s gate_weight" %
                          (ffn, "needs" if gated else "takes no"))
    biases = {"fc1_bias": fc1_bias, "fc2_bias": fc2_bias}
    if gated:
        biases["gate_bias"] = gate_bias
    elif gate_bias is not None:
        raise ConfigError("teo.ops.ffn: ffn=%r takes no gate_bias" % (ffn,))
    given = [k for k, b in biases.items() if b is not None]
    if given and len(given) != len(biases):
        raise ConfigError("teo.ops.ffn: the biases are all given or all left out; got only %s"
                          % ", ".join(given))
    spec = {"rows": n, "d_model": d, "d_ff": w1[0], "ffn": ffn, "ffn_bias": bool(given),
            "activation": activation}
    inputs = {"input.x": x, "param.gate.weight": gate_weight, "param.gate.bias": gate_bias,
              "param.fc1.weight": fc1_weight, "param.fc1.bias": fc1_bias,
              "param.fc2.weight": fc2_weight, "param.fc2.bias": fc2_bias}
    return _call("ffn", spec, inputs, {"output.y": grad_y}, **kw)


@_public()
def lm_head(x, weight, tokens, lengths, bias=None, *, label_smoothing=0.0, grad_loss=None, **kw):
    """A decoder's LM head and next-token loss: logits = x weight^T + bias (B, S, V); position t
    of sequence b predicts tokens[b, t + 1] when t + 1 < lengths[b]; the loss is the mean over
    those positions (0 when there are none). For a tied head, weight is the embedding matrix."""
    x = _real(x, "x", "lm_head")
    b, s, d = _dims(x, 3, "(batch, seq_len, d_model)", "x", "lm_head")
    v = _dims(_real(weight, "weight", "lm_head"), 2, "(vocab_size, d_model)", "weight",
              "lm_head")[0]
    lengths = _ints(lengths, "lengths", "lm_head")
    spec = {"batch": b, "seq_len": s, "vocab_size": v, "d_model": d, "lengths": lengths,
            "head_bias": bias is not None, "label_smoothing": label_smoothing}
    return _call("lm_head", spec,
                 {"input.x": x, "input.tokens": _int_array(tokens, "tokens", "lm_head"),
                  "input.lengths": np.asarray(lengths, dtype=np.int64),
                  "param.weight": weight, "param.bias": bias}, {"output.loss": grad_loss}, **kw)


@_public()
def dropout(x, mask, *, dropout, grad_y=None, **kw):
    x = _real(x, "x", "dropout")
    n, c = _rows(x)
    return _call("dropout", {"rows": n, "cols": c, "dropout": dropout},
                 {"input.x": x, "input.mask": as_array(mask).astype(np.uint8)},
                 {"output.y": grad_y}, **kw)


# The attention variants' spec keys (docs/semantics.md section 14), passed through as given.
ATTENTION_VARIANT_KEYS = ("positional", "rope_style", "rotary_dim", "rope_base", "rope_scaling",
                          "alibi_max_bias", "position_offset", "sliding_window",
                          "attn_logit_softcap")


def _heads_and_variants(spec, h, kv_heads, dh, dv, sinks, scale, kw):
    """The attention ops' spec keys beyond the sizes: the K/V heads and value head size when
    they differ from q's, the variants given as keywords (taken out of kw), sinks and scale."""
    if dv != dh:
        spec["d_head_v"] = int(dv)
    if kv_heads != h:
        spec["num_kv_heads"] = int(kv_heads)
    for key in ATTENTION_VARIANT_KEYS:
        if key in kw:
            spec[key] = kw.pop(key)
    if sinks is not None:
        spec["attn_sinks"] = True
    if scale is not None:
        spec["scale"] = scale


@_public(*ATTENTION_VARIANT_KEYS)
def attention(q, k, v, lengths=None, *, kv_lengths=None, causal=False, causal_align=None,
              scale=None, probs=None, lse=None, sinks=None, grad_context=None, grad_lse=None,
              **kw):
    """q (B, H, Sq, Dh), k (B, Hkv, Skv, Dh), v (B, Hkv, Skv, Dv): k and v may have fewer heads
    than q (grouped-query attention), fewer or more rows (decode, chunked prefill: Sq != Skv) and
    v another head size (MLA). lengths are the queries of each sequence (and its keys, unless
    kv_lengths); causal_align "bottom_right" (the default) or "top_left" places the causal
    diagonal when a sequence has fewer queries than keys; lse=True also returns output.lse (the
    default with Sq != Skv); grad_lse (B, H, Sq) is an upstream gradient for it, as a split-KV
    backward gets from attention_merge (and implies lse=True). sinks (H) adds a learned sink logit per head; the other variants are
    keywords: positional ("none", "rope", "alibi"), rope_style, rotary_dim, rope_base,
    rope_scaling, alibi_max_bias, position_offset, sliding_window, attn_logit_softcap."""
    q, k, v = (_real(a, n, "attention") for a, n in ((q, "q"), (k, "k"), (v, "v")))
    b, h, s, dh = _dims(q, 4, "(B, H, Sq, Dh)", "q", "attention")
    s_kv = k.shape[2] if k.ndim == 4 else s
    dv = v.shape[3] if v.ndim == 4 else dh
    lengths = [s] * b if lengths is None else _ints(lengths, "lengths", "attention")
    split = s_kv != s or kv_lengths is not None or causal_align is not None
    spec = {"batch": b, "num_heads": h, "d_head": dh, "causal": causal}
    inputs = {"input.q": q, "input.k": k, "input.v": v, "param.sinks": sinks}
    if split:
        kv_lengths = [s_kv] * b if kv_lengths is None else _ints(kv_lengths, "kv_lengths",
                                                                    "attention")
        spec.update(q_len=s, kv_len=int(s_kv), q_lengths=lengths, kv_lengths=kv_lengths)
        if causal_align is not None:
            spec["causal_align"] = causal_align
        inputs["input.q_lengths"] = np.asarray(lengths, dtype=np.int64)
        inputs["input.kv_lengths"] = np.asarray(kv_lengths, dtype=np.int64)
    else:
        spec.update(seq_len=s, lengths=lengths)
        inputs["input.lengths"] = np.asarray(lengths, dtype=np.int64)
    _heads_and_variants(spec, h, k.shape[1] if k.ndim == 4 else h, dh, dv, sinks, scale, kw)
    if probs is not None:
        spec["probs"] = probs
    if lse is not None:
        spec["lse"] = bool(lse)
    if grad_lse is not None:
        spec["lse_grad"] = True
    return _call("attention", spec, inputs,
                 {"output.context": grad_context, "output.lse": grad_lse}, **kw)


@_public(*ATTENTION_VARIANT_KEYS)
def attention_kvcache(q, k_new, v_new, cache_lengths, *, k_cache=None, v_cache=None,
                      k_pages=None, v_pages=None, block_table=None, causal=True, scale=None,
                      lse=True, sinks=None, **kw):
    """One serving step, forward only: k_new and v_new (B, Hkv, Sq, Dh|Dv) are appended to each
    sequence's cache at position cache_lengths[b] + i, RoPE (when positional="rope") rotates the
    new q (B, H, Sq, Dh) and keys at those positions, and the queries attend bottom-right to the
    cache_lengths[b] + Sq tokens. The cache is contiguous, k_cache and v_cache (B, Hkv, max_len,
    Dh|Dv), or paged, k_pages and v_pages (num_pages, page_size, Hkv, Dh|Dv) with block_table
    (B, max_pages) of page indices. Returns output.context, output.lse (unless lse=False), the
    updated cache (output.k_cache/v_cache or output.k_pages/v_pages) and, with RoPE,
    output.q_rot. The attention variants are keywords, as in attention()."""
    from . import ConfigError
    what = "attention_kvcache"
    paged = k_pages is not None or v_pages is not None or block_table is not None
    if paged and (k_cache is not None or v_cache is not None):
        raise ConfigError("teo.ops.attention_kvcache takes k_cache and v_cache (contiguous) or "
                          "k_pages, v_pages and block_table (paged), not both")
    q, k_new, v_new = (_real(a, n, what) for a, n in ((q, "q"), (k_new, "k_new"),
                                                        (v_new, "v_new")))
    b, h, s, dh = _dims(q, 4, "(B, H, Sq, Dh)", "q", what)
    kv_heads = _dims(k_new, 4, "(B, Hkv, Sq, Dh)", "k_new", what)[1]
    dv = _dims(v_new, 4, "(B, Hkv, Sq, Dv)", "v_new", what)[3]
    cache_lengths = _ints(cache_lengths, "cache_lengths", what)
    spec = {"batch": b, "num_heads": h, "q_len": s, "d_head": dh, "causal": causal,
            "cache_lengths": cache_lengths, "lse": bool(lse)}
    inputs = {"input.q": q, "input.k_new": k_new, "input.v_new": v_new,
              "input.cache_lengths": np.asarray(cache_lengths, dtype=np.int64),
              "param.sinks": sinks}
    if paged:
        if k_pages is None or v_pages is None or block_table is None:
            raise ConfigError("a paged cache needs k_pages, v_pages and block_table")
        k_pages, v_pages = _real(k_pages, "k_pages", what), _real(v_pages, "v_pages", what)
        _dims(k_pages, 4, "(num_pages, page_size, Hkv, Dh)", "k_pages", what)
        table = np.asarray(_ints(block_table, "block_table", what), dtype=np.int64)
        table = table.reshape(_dims(as_array(block_table), 2, "(B, max_pages)", "block_table",
                                    what))
        spec.update(layout="paged", page_size=int(k_pages.shape[1]),
                    num_pages=int(k_pages.shape[0]), block_table=table.tolist())
        inputs.update({"input.k_pages": k_pages, "input.v_pages": v_pages,
                       "input.block_table": table.astype(np.int32)})
    else:
        if k_cache is None or v_cache is None:
            raise ConfigError("teo.ops.attention_kvcache needs k_cache and v_cache, or "
                              "k_pages, v_pages and block_table")
        k_cache, v_cache = _real(k_cache, "k_cache", what), _real(v_cache, "v_cache", what)
        spec["max_len"] = int(_dims(k_cache, 4, "(B, Hkv, max_len, Dh)", "k_cache", what)[2])
        inputs.update({"input.k_cache": k_cache, "input.v_cache": v_cache})
    _heads_and_variants(spec, h, kv_heads, dh, dv, sinks, scale, kw)
    return _call(what, spec, inputs, {}, **kw)


@_public()
def attention_merge(context_parts, lse_parts, *, grad_context=None, grad_lse=None, **kw):
    """The split-KV combine: context_parts (P, B, H, Sq, Dv) and lse_parts (P, B, H, Sq), each
    part's attention over its share of the keys, merge into output.lse = log sum_p exp(lse_p)
    and output.context = sum_p exp(lse_p - lse) context_p; a part with lse -inf contributes
    nothing. The backward gives grad.input.context_parts and grad.input.lse_parts."""
    what = "attention_merge"
    c, l = _real(context_parts, "context_parts", what), _real(lse_parts, "lse_parts", what)
    p, b, h, s, dv = _dims(c, 5, "(P, B, H, Sq, Dv)", "context_parts", what)
    spec = {"num_parts": p, "batch": b, "num_heads": h, "q_len": s, "d_head_v": dv}
    return _call(what, spec, {"input.context_parts": c, "input.lse_parts": l},
                 {"output.context": grad_context, "output.lse": grad_lse}, **kw)


@_public()
def embedding(tokens, weight, pos_weight=None, *, positional="sinusoidal", embed_scale=False,
              token_types=None, type_weight=None, norm_weight=None, norm_bias=None,
              norm="layernorm", layer_norm_eps=None, grad_x=None, **kw):
    """output.x = weight[tokens] (times sqrt(D) with embed_scale) + the positions; with
    token_types and type_weight (Tv, D) BERT's token-type rows are added first, and with
    norm_weight (and norm_bias for "layernorm") the sum goes through the embedding norm
    (docs/semantics.md section 18)."""
    tokens, weight = as_array(tokens), _real(weight, "weight", "embedding")
    if pos_weight is not None:
        pos_weight = _real(pos_weight, "pos_weight", "embedding")
    b, s = tokens.shape
    v, d = weight.shape
    spec = {"batch": b, "seq_len": s, "vocab_size": v, "d_model": d, "positional": positional,
            "embed_scale": embed_scale}
    if positional == "learned":
        spec["max_len"] = int(pos_weight.shape[0])
    inputs = {"input.tokens": tokens.astype(np.int64), "param.weight": weight,
              "param.pos_weight": pos_weight}
    from . import ConfigError
    if (token_types is None) != (type_weight is None):
        raise ConfigError("embedding: token_types and type_weight go together")
    if norm_weight is None and (norm_bias is not None or norm != "layernorm"
                                or layer_norm_eps is not None):
        raise ConfigError("embedding: norm_bias, norm and layer_norm_eps need norm_weight (the "
                          "embedding norm)")
    if (norm == "rmsnorm") == (norm_bias is not None) and norm_weight is not None:
        raise ConfigError("embedding: a layernorm takes norm_bias, an rmsnorm none")
    if type_weight is not None:
        type_weight = _real(type_weight, "type_weight", "embedding")
        spec["type_vocab_size"] = int(type_weight.shape[0])
        inputs.update({"input.token_types": as_array(token_types).astype(np.int64),
                       "param.type_weight": type_weight})
    if norm_weight is not None:
        spec["embedding_norm"] = True
        if norm != "layernorm":
            spec["norm"] = norm
        if layer_norm_eps is not None:
            spec["layer_norm_eps"] = layer_norm_eps
        inputs["param.norm_weight"] = _real(norm_weight, "norm_weight", "embedding")
        if norm_bias is not None:
            inputs["param.norm_bias"] = _real(norm_bias, "norm_bias", "embedding")
    return _call("embedding", spec, inputs, {"output.x": grad_x}, **kw)


@_public()
def patch_embedding(pixels, weight, bias, cls_token, *, grad_x=None, **kw):
    """ViT's patch embedding (docs/semantics.md section 18.5): pixels (B, Ch, Img, Img) cut into
    P x P patches, weight (D, Ch, P, P) a Conv2d's, bias and cls_token (D). output.x (B, 1 + Np,
    D), Np = (Img / P)^2: row 0 of each image is cls_token, row 1 + n the patch n = py G + px
    (G = Img / P) flattened in (Ch, P, P) order times weight^T plus bias, as
    F.conv2d(pixels, weight, bias, stride=P).flatten(2).transpose(1, 2)."""
    what = "patch_embedding"
    pixels = _real(pixels, "pixels", what)
    b, ch, img, img2 = _dims(pixels, 4, "(batch, channels, image_size, image_size)", "pixels",
                             what)
    weight = _real(weight, "weight", what)
    d, wch, p, p2 = _dims(weight, 4, "(d_model, channels, patch_size, patch_size)", "weight",
                          what)
    from . import ShapeError
    if img2 != img or p2 != p:
        raise ShapeError("teo.ops.patch_embedding: images and patches are square; got pixels %s, "
                         "weight %s" % (pixels.shape, weight.shape))
    if wch != ch:
        raise ShapeError("teo.ops.patch_embedding: weight has %d channels, pixels %d"
                         % (wch, ch))
    spec = {"batch": b, "channels": ch, "image_size": img, "patch_size": p, "d_model": d}
    return _call(what, spec, {"input.pixels": pixels, "param.weight": weight,
                              "param.bias": bias, "param.cls_token": cls_token},
                 {"output.x": grad_x}, **kw)


@_public()
def pooling(x, lengths, *, pooling="mean", grad_pooled=None, **kw):
    x = _real(x, "x", "pooling")
    b, s, d = x.shape
    lengths = _ints(lengths, "lengths", "pooling")
    return _call("pooling", {"batch": b, "seq_len": s, "d_model": d, "lengths": lengths,
                             "pooling": pooling},
                 {"input.x": x, "input.lengths": np.asarray(lengths, dtype=np.int64)},
                 {"output.pooled": grad_pooled}, **kw)


@_public()
def cross_entropy(logits, labels, *, label_smoothing=0.0, grad_loss=None, **kw):
    logits = _real(logits, "logits", "cross_entropy")
    n, c = _rows(logits)
    return _call("cross_entropy", {"batch": n, "num_classes": c,
                                   "label_smoothing": label_smoothing},
                 {"input.logits": logits, "input.labels": as_array(labels).astype(np.int64)},
                 {"output.loss": grad_loss}, **kw)


@_public()
def moe_router(x, gate_weight, *, num_experts_per_tok, gate_bias=None,
               e_score_correction_bias=None, topk_ids=None, router_scoring="softmax",
               router_order="score_then_topk", router_groups=1, topk_groups=None,
               group_score="top2_sum", norm_topk_prob=False, routed_scaling_factor=1.0,
               aux_losses=True, grad_topk_weights=None, grad_aux_loss=None, grad_z_loss=None,
               **kw):
    """A mixture of experts' router (docs/semantics.md, 19.1) on x (T, D) with the gate
    (E, D): output.logits, output.scores, output.topk_ids (int32), output.topk_weights,
    output.selection_margin and, with aux_losses, output.aux_loss and output.z_loss, with the
    gradients. topk_ids (T, k) replays a routing; e_score_correction_bias is DeepSeek-V3's."""
    x = _real(x, "x", "moe_router")
    gate_weight = _real(gate_weight, "gate_weight", "moe_router")
    t, d = _rows(x)
    e = _dims(gate_weight, 2, "(E, D)", "gate_weight", "moe_router")[0]
    spec = {"tokens": t, "d_model": d, "num_experts": e,
            "num_experts_per_tok": num_experts_per_tok, "router_scoring": router_scoring,
            "router_order": router_order, "norm_topk_prob": norm_topk_prob,
            "routed_scaling_factor": routed_scaling_factor, "router_bias": gate_bias is not None,
            "selection_bias": e_score_correction_bias is not None,
            "replay_routing": topk_ids is not None, "aux_losses": aux_losses}
    if router_groups != 1:
        spec.update(router_groups=router_groups, topk_groups=topk_groups, group_score=group_score)
    inputs = {"input.x": x, "param.gate.weight": gate_weight, "param.gate.bias": gate_bias,
              "param.gate.e_score_correction_bias": e_score_correction_bias}
    if topk_ids is not None:
        inputs["input.moe.topk_ids"] = _int_array(topk_ids, "topk_ids", "moe_router").astype(
            np.int32)
    return _call("moe_router", spec, inputs,
                 {"output.topk_weights": grad_topk_weights, "output.aux_loss": grad_aux_loss,
                  "output.z_loss": grad_z_loss}, **kw)


# The moe op's router and expert options (its spec keys the function does not fill in).
MOE_OPTIONS = ("router_scoring", "router_order", "router_groups", "topk_groups", "group_score",
               "norm_topk_prob", "routed_scaling_factor", "expert_kind", "swiglu_alpha",
               "swiglu_limit", "weight_at", "shared_expert_gate", "aux_losses")


@_public(*MOE_OPTIONS)
def moe(x, params, *, num_experts_per_tok, topk_ids=None, grad_y=None, grad_aux_loss=None,
        grad_z_loss=None, **options):
    """A mixture-of-experts block (docs/semantics.md, 19) on x (T, D). params by teo's names
    without "param.": gate.weight (E, D) and optionally gate.bias, gate.e_score_correction_bias;
    experts.w_gate, experts.w_up (E, F, D), experts.w_down (E, D, F) and optionally their biases
    experts.b_gate, experts.b_up (E, F), experts.b_down (E, D); shared experts shared.gate.weight,
    shared.fc1.weight (Fs, D), shared.fc2.weight (D, Fs) and shared_gate.weight (1, D). Returns
    the router's outputs, the grouped layout (act.moe.*), output.y and the gradients."""
    from . import ConfigError
    x = _real(x, "x", "moe")
    t, d = _rows(x)
    p = {n: _real(a, n, "moe") for n, a in params.items() if a is not None}
    for need in ("gate.weight", "experts.w_gate", "experts.w_up", "experts.w_down"):
        if need not in p:
            raise ConfigError("teo.ops.moe: params needs %s" % need)
    e = _dims(p["gate.weight"], 2, "(E, D)", "gate.weight", "moe")[0]
    f = _dims(p["experts.w_gate"], 3, "(E, F, D)", "experts.w_gate", "moe")[1]
    spec = {"tokens": t, "d_model": d, "num_experts": e, "num_experts_per_tok": num_experts_per_tok,
            "moe_d_ff": f, "router_bias": "gate.bias" in p,
            "selection_bias": "gate.e_score_correction_bias" in p,
            "expert_bias": "experts.b_gate" in p, "replay_routing": topk_ids is not None,
            "shared_d_ff": p["shared.gate.weight"].shape[0] if "shared.gate.weight" in p else 0}
    spec.update({k: v for k, v in options.items() if v is not None and k not in RUN_KEYS})
    spec.setdefault("shared_expert_gate", "shared_gate.weight" in p)
    inputs = {"input.x": x}
    inputs.update({"param." + n: a for n, a in p.items()})
    if topk_ids is not None:
        inputs["input.moe.topk_ids"] = _int_array(topk_ids, "topk_ids", "moe").astype(np.int32)
    return _call("moe", spec, inputs, {"output.y": grad_y, "output.aux_loss": grad_aux_loss,
                                      "output.z_loss": grad_z_loss},
                 **{k: options[k] for k in RUN_KEYS if k in options})


# The encoder_layer spec keys the function fills in from its arguments; the op's other keys (the
# registry's) are its options.
_LAYER_SET = ("op", "dtype", "seed", "batch", "seq_len", "lengths", "d_model")
ENCODER_LAYER_OPTIONS = tuple(k for k in _teo.op_keys("encoder_layer")
                              if k not in _LAYER_SET + RUN_KEYS)


@_public(*ENCODER_LAYER_OPTIONS)
def encoder_layer(x, lengths, params, *, masks=None, grad_y=None, **options):
    """One encoder layer: params by the model's names without "layers.{i}." ("attn.q.weight",
    ...); options (ENCODER_LAYER_OPTIONS): num_heads, d_ff, activation, norm_first, causal,
    layer_norm_eps, dropout, and the attention variants' config keys (num_kv_heads, positional,
    ..., attn_sinks). With dropout, masks {"attn", "residual1", "ffn", "residual2"} must be the
    ones the seed 0 draws (teo.golden.op_case gives them)."""
    x = _real(x, "x", "encoder_layer")
    b, s, d = x.shape
    lengths = _ints(lengths, "lengths", "encoder_layer")
    run_kw = {k: options.pop(k) for k in RUN_KEYS if k in options}
    spec = dict(options, batch=b, seq_len=s, lengths=lengths, d_model=d)
    inputs = {"input.x": x, "input.lengths": np.asarray(lengths, dtype=np.int64)}
    for n, a in (masks or {}).items():
        inputs["input.mask." + n] = as_array(a).astype(np.uint8)
    for n, a in params.items():
        inputs["param." + n] = a
    return _call("encoder_layer", spec, inputs, {"output.y": grad_y}, **run_kw)


# The decoder_layer spec keys the function fills in from its arguments.
_DECODER_SET = _LAYER_SET + ("memory_len", "memory_lengths")
DECODER_LAYER_OPTIONS = tuple(k for k in _teo.op_keys("decoder_layer")
                              if k not in _DECODER_SET + RUN_KEYS)


@_public(*DECODER_LAYER_OPTIONS)
def decoder_layer(x, lengths, params, *, memory=None, memory_lengths=None, grad_y=None,
                  **options):
    """One decoder layer: causal self-attention over x (B, T, D) with its lengths, cross-attention
    over memory (B, Se, D) with memory_lengths (the source padding mask) when given, and the FFN;
    params by the op's names ("self_attn.q.weight", "cross_attn.q.weight", "norm1.weight",
    "ffn.fc1.weight", ...); options (DECODER_LAYER_OPTIONS): num_heads, num_kv_heads, d_ff,
    activation, norm_first, layer_norm_eps, norm, ffn, ffn_bias, attn_bias, attn_out_bias."""
    x = _real(x, "x", "decoder_layer")
    b, s, d = x.shape
    lengths = _ints(lengths, "lengths", "decoder_layer")
    run_kw = {k: options.pop(k) for k in RUN_KEYS if k in options}
    spec = dict(options, batch=b, seq_len=s, lengths=lengths, d_model=d)
    inputs = {"input.x": x, "input.lengths": np.asarray(lengths, dtype=np.int64)}
    from . import ConfigError, ShapeError
    if memory is None:
        if memory_lengths is not None:
            raise ConfigError("teo.ops.decoder_layer: memory_lengths without a memory")
    else:
        memory = _real(memory, "memory", "decoder_layer")
        if memory.ndim != 3:
            raise ShapeError("teo.ops.decoder_layer: memory must be (batch, memory_len, d_model), "
                             "got shape %s" % (memory.shape,))
        se = memory.shape[1]
        memory_lengths = ([se] * b if memory_lengths is None
                          else _ints(memory_lengths, "memory_lengths", "decoder_layer"))
        spec.update(memory_len=se, memory_lengths=memory_lengths)
        inputs["input.memory"] = memory
        inputs["input.memory_lengths"] = np.asarray(memory_lengths, dtype=np.int64)
    for n, a in params.items():
        inputs["param." + n] = a
    return _call("decoder_layer", spec, inputs, {"output.y": grad_y}, **run_kw)
