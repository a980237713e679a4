#!/usr/bin/python3
"""Replays a `teo train --trace` run in PyTorch and checks that it is exact.

A trace ("teo-train-trace/1", safetensors) holds the config, the training
hyper-parameters, the parameters before step 1, every micro-batch of every
optimizer step, teo's loss, learning rate and pre-clipping gradient norm at
each step, and the parameters after the last step. This script loads the
initial parameters as float64 leaves and trains them with ordinary PyTorch:
the model from tests/interop/torch_backend.py, gradient accumulation by
`(loss_m / accum_steps).backward()`, torch.nn.utils.clip_grad_norm_,
torch.optim.AdamW with weight decay on the 2-D parameters only, and
LambdaLR with teo's warm-up / inverse-square-root schedule. After every step
it compares loss, lr and grad_norm with teo's, and at the end every
parameter.

Usage:
  /usr/bin/python3 tests/interop/train_exactness.py TRACE [--allow-no-clip]
  /usr/bin/python3 tests/interop/train_exactness.py --self-test

Bounds (the trace must be float64): loss and grad_norm relative 1e-9, lr
relative 1e-15, each final parameter max|torch - teo| <= 1e-9 *
max(max|teo|, 1e-3). At least one step must have been clipped (clip_norm >
0 and the coefficient below 1), or the run would not exercise clipping.
On a mismatch the replay is repeated with a hand-written AdamW under a set
of plausible deviations (decay on biases, lr off by one step, eps inside the
square root, ...) and the ones that explain the trace are named.

--self-test writes traces from an independent PyTorch model
(F.multi_head_attention_forward, a hand-written AdamW, schedule and
clipping), checks that they pass, that perturbing one loss by 1e-8, one lr
by 1e-14, one grad_norm or one parameter makes the check fail, and that a
trace trained with decayed biases is caught and diagnosed.

Exit status: 0 all checks passed, 1 a mismatch (the step and quantity, or
the parameter, are printed), 2 bad input (unreadable or malformed trace,
a dtype other than float64, a config this replay cannot express).
"""

import argparse
import contextlib
import io
import json
import math
import os
import sys
import tempfile

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_backend as tb  # noqa: E402  (the path is set just above)

FORMAT = "teo-train-trace/1"
RTOL_LOSS = 1e-9
RTOL_LR = 1e-15
RTOL_GRAD_NORM = 1e-9
RTOL_PARAM = 1e-9
PARAM_SCALE_FLOOR = 1e-3
CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_: coef = max / (total + 1e-6)
TRAIN_KEYS = ("lr", "warmup_steps", "weight_decay", "beta1", "beta2",
              "adam_eps", "clip_norm", "accum_steps", "batch_size", "dtype")


class BadInput(Exception):
    """A missing or malformed trace, or one this replay cannot check."""


# ---------------------------------------------------------------------------
# Reading and validating the trace
# ---------------------------------------------------------------------------

def param_shapes(cfg):
    """name -> shape, in canonical order (docs/semantics.md section 3)."""
    V, M = cfg["vocab_size"], cfg["max_len"]
    D, Fd, C = cfg["d_model"], cfg["d_ff"], cfg["num_classes"]
    shapes = {}
    for name in tb.param_names(cfg):
        if name == "embedding.weight":
            shapes[name] = (V, D)
        elif name == "pos_embedding.weight":
            shapes[name] = (M, D)
        elif name.endswith("ffn.fc1.weight"):
            shapes[name] = (Fd, D)
        elif name.endswith("ffn.fc1.bias"):
            shapes[name] = (Fd,)
        elif name.endswith("ffn.fc2.weight"):
            shapes[name] = (D, Fd)
        elif name == "head.weight":
            shapes[name] = (C, D)
        elif name == "head.bias":
            shapes[name] = (C,)
        elif name.endswith(".weight") and ".attn." in name:
            shapes[name] = (D, D)
        else:  # attention and fc2 biases, norm weights and biases
            shapes[name] = (D,)
    return shapes


def _json_meta(meta, key):
    if key not in meta:
        raise BadInput("__metadata__ has no %r" % key)
    try:
        value = json.loads(meta[key])
    except ValueError as e:
        raise BadInput("__metadata__.%s is not valid JSON (%s)" % (key, e))
    if not isinstance(value, dict):
        raise BadInput("__metadata__.%s is not a JSON object" % key)
    return value


def _number(train, key, integer=False):
    v = train[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) \
            or (integer and not isinstance(v, int)) or not math.isfinite(v):
        raise BadInput("train.%s = %r is not a%s" % (
            key, v, "n integer" if integer else " finite number"))
    return v


def _scalar(tensors, name):
    if name not in tensors:
        raise BadInput("missing tensor %s" % name)
    a = tensors[name]
    if a.dtype != np.float64 or a.shape != ():
        raise BadInput("%s must be an F64 scalar (shape []), got %s %s"
                       % (name, a.dtype, list(a.shape)))
    return float(a)


def load_trace(path):
    """Returns a dict: cfg, train, steps, init, final, batches, teo."""
    try:
        tensors, meta = tb.st_read(path)
    except tb.BadInput as e:
        raise BadInput(str(e))
    if meta.get("format") != FORMAT:
        raise BadInput("__metadata__.format is %r, expected %r"
                       % (meta.get("format"), FORMAT))

    cfg_in = _json_meta(meta, "config")
    unknown = sorted(set(cfg_in) - set(tb.CONFIG_DEFAULTS))
    if unknown:
        raise BadInput("unknown config keys: %s" % ", ".join(unknown))
    cfg = dict(tb.CONFIG_DEFAULTS)
    cfg.update(cfg_in)
    block = [k for k in ("architecture", "norm", "ffn", "ffn_bias", "attn_bias", "attn_out_bias",
                         "head_bias", "tie_embeddings") if cfg[k] != tb.CONFIG_DEFAULTS[k]]
    if block:
        raise BadInput("config sets %s: this replay knows the encoder classifier's plain "
                       "layer only" % ", ".join(block))
    if cfg["activation"] not in ("relu", "gelu", "gelu_tanh") \
            or cfg["positional"] not in ("sinusoidal", "learned") \
            or cfg["pooling"] not in ("mean", "cls", "max"):
        raise BadInput("config has an activation/positional/pooling this "
                       "replay does not know: %s/%s/%s" % (
                           cfg["activation"], cfg["positional"],
                           cfg["pooling"]))
    if cfg["dropout"] != 0:
        raise BadInput("config.dropout = %r: a trace carries no dropout "
                       "masks, so only dropout 0 can be replayed"
                       % cfg["dropout"])

    train = _json_meta(meta, "train")
    missing = [k for k in TRAIN_KEYS if k not in train]
    if missing:
        raise BadInput("train metadata lacks %s" % ", ".join(missing))
    if train["dtype"] != "float64":
        raise BadInput("train.dtype is %r: this check needs a float64 run "
                       "(its 1e-9 bounds are for double)" % train["dtype"])
    for k in ("lr", "weight_decay", "beta1", "beta2", "adam_eps",
              "clip_norm"):
        _number(train, k)
    for k in ("warmup_steps", "accum_steps", "batch_size"):
        _number(train, k, integer=True)
    if train["accum_steps"] < 1:
        raise BadInput("train.accum_steps = %d must be >= 1"
                       % train["accum_steps"])
    if train["warmup_steps"] < 1:
        raise BadInput("train.warmup_steps = %d: the schedule "
                       "min(n/W, sqrt(W/n)) needs W >= 1"
                       % train["warmup_steps"])
    try:
        steps = int(meta.get("steps", ""))
    except ValueError:
        raise BadInput("__metadata__.steps = %r is not an integer"
                       % meta.get("steps"))
    if steps < 1:
        raise BadInput("__metadata__.steps = %d: nothing to check" % steps)

    shapes = param_shapes(cfg)
    params = {}
    for prefix in ("init.", "final."):
        params[prefix] = {}
        for name, shape in shapes.items():
            key = prefix + name
            if key not in tensors:
                raise BadInput("missing tensor %s" % key)
            a = tensors[key]
            if a.dtype != np.float64 or tuple(a.shape) != shape:
                raise BadInput("%s is %s %s, expected F64 %s" % (
                    key, a.dtype, list(a.shape), list(shape)))
            params[prefix][name] = a
        extra = sorted(k for k in tensors if k.startswith(prefix)
                       and k[len(prefix):] not in shapes)
        if extra:
            raise BadInput("unexpected parameter %s for this config"
                           % extra[0])

    V, C, M = cfg["vocab_size"], cfg["num_classes"], cfg["max_len"]
    batches, teo = [], []
    for n in range(1, steps + 1):
        micro = []
        for m in range(train["accum_steps"]):
            p = "step.%d.%d." % (n, m)
            arrs = []
            for what in ("tokens", "lengths", "labels"):
                if p + what not in tensors:
                    raise BadInput("missing tensor %s%s" % (p, what))
                a = tensors[p + what]
                if a.dtype != np.int64:
                    raise BadInput("%s%s is %s, expected I64"
                                   % (p, what, a.dtype))
                arrs.append(a)
            tokens, lengths, labels = arrs
            if tokens.ndim != 2:
                raise BadInput("%stokens has shape %s, expected [b, S]"
                               % (p, list(tokens.shape)))
            b, S = tokens.shape
            if lengths.shape != (b,) or labels.shape != (b,):
                raise BadInput("%slengths/labels have shapes %s/%s, "
                               "expected [%d]" % (p, list(lengths.shape),
                                                  list(labels.shape), b))
            if not 1 <= S <= M:
                raise BadInput("%stokens: seq_len %d outside [1, max_len "
                               "%d]" % (p, S, M))
            if b and (tokens.min() < 0 or tokens.max() >= V):
                raise BadInput("%stokens: an id outside [0, %d)" % (p, V))
            if b and (lengths.min() < 0 or lengths.max() > S):
                raise BadInput("%slengths: a length outside [0, %d]"
                               % (p, S))
            if b and (labels.min() < 0 or labels.max() >= C):
                raise BadInput("%slabels: a label outside [0, %d)" % (p, C))
            micro.append(tuple(torch.from_numpy(a) for a in arrs))
        batches.append(micro)
        teo.append({q: _scalar(tensors, "step.%d.%s" % (n, q))
                    for q in ("loss", "lr", "grad_norm")})
    extra_steps = sorted(k for k in tensors if k.startswith("step.")
                         and k.split(".")[1].isdigit()
                         and not 1 <= int(k.split(".")[1]) <= steps)
    if extra_steps:
        raise BadInput("%s lies beyond __metadata__.steps = %d"
                       % (extra_steps[0], steps))
    return {"cfg": cfg, "train": train, "steps": steps,
            "init": params["init."], "final": params["final."],
            "batches": batches, "teo": teo}


# ---------------------------------------------------------------------------
# The model: torch_backend's layers, without dropout (the trace has none)
# ---------------------------------------------------------------------------

class Model:
    def __init__(self, cfg):
        self.cfg = cfg
        self.no_dropout = tb.Dropout({}, 0.0, torch.float64)
        self.tables = {}

    def positional(self, P, S):
        cfg = self.cfg
        if cfg["positional"] == "learned":
            return P["pos_embedding.weight"][:S]
        if S not in self.tables:
            self.tables[S] = tb.sinusoidal_table(S, cfg["d_model"],
                                                 torch.float64)
        return self.tables[S]

    def loss(self, P, tokens, lengths, labels):
        """Mean label-smoothed cross-entropy of one micro-batch."""
        cfg = self.cfg
        B, S = tokens.shape
        scale = math.sqrt(cfg["d_model"]) if cfg["embed_scale"] else 1.0
        x = F.embedding(tokens, P["embedding.weight"]) * scale \
            + self.positional(P, S)
        # visible[b, 0, i, j]: key j is a real token (and j <= i if causal).
        j = torch.arange(S)
        visible = (j[None, None, :] < lengths[:, None, None]).expand(B, S, S)
        if cfg["causal"]:
            visible = visible & (j[None, :, None] >= j[None, None, :])
        visible = visible[:, None, :, :]
        acts = {}
        for i in range(cfg["num_layers"]):
            x = tb.encoder_layer(x, i, cfg, P, visible, self.no_dropout,
                                 acts)
        if cfg["norm_first"]:
            x = tb.layer_norm(x, "final_norm", P, cfg["layer_norm_eps"])
        pooled = tb.pool(x, lengths, cfg["pooling"])
        logits = F.linear(pooled, P["head.weight"], P["head.bias"])
        return tb.loss_fn(logits, labels, cfg["label_smoothing"])


# ---------------------------------------------------------------------------
# Training: PyTorch's own optimizer, or a hand-written one with deviations
# ---------------------------------------------------------------------------

def schedule_factor(n, warmup):
    """The lr multiplier of optimizer step n (1-based)."""
    return min(n / warmup, math.sqrt(warmup / n))


# Deviations a buggy AdamW / schedule / clipping might have; used to explain
# a mismatch, and to make faulty traces for the self-test.
VARIANTS = {
    "wd_all": "weight decay applied to every parameter (biases, norms too)",
    "wd_none": "no weight decay at all",
    "wd_l2": "L2 term wd*p added to the gradient (Adam) instead of "
             "decoupled decay (AdamW)",
    "wd_base_lr": "decay factor 1 - lr_base*wd (unscheduled lr)",
    "wd_no_lr": "decay factor 1 - wd (no lr)",
    "wd_after": "decay applied after the Adam update instead of before",
    "eps_inside_sqrt": "denominator sqrt(v_hat + eps)",
    "eps_unscaled": "denominator sqrt(v) + eps with step "
                    "lr*sqrt(1-b2^t)/(1-b1^t) (eps before bias correction)",
    "no_bias_correction": "no bias correction of m and v",
    "bias_correction_next": "bias correction with t+1 instead of t",
    "betas_swapped": "beta1 and beta2 swapped",
    "lr_next": "step n uses the schedule factor of step n+1",
    "lr_prev": "step n uses the schedule factor of step n-1",
    "lr_const": "no schedule (constant lr)",
    "clip_no_eps": "clip coefficient clip/total (no +1e-6)",
    "clip_off": "no gradient clipping",
    "clip_always": "gradients always scaled by clip/(total+1e-6), even "
                   "when that exceeds 1",
    "grad_sum": "micro-batch gradients summed, not divided by accum_steps",
}


class ManualAdamW:
    """AdamW written out by hand; `variant` names one deviation (or '')."""

    def __init__(self, named, train, variant=""):
        self.named = named
        self.train = train
        self.variant = variant
        self.t = 0
        self.m = {n: torch.zeros_like(p) for n, p in named}
        self.v = {n: torch.zeros_like(p) for n, p in named}

    @torch.no_grad()
    def step(self, lr):
        tr, var = self.train, self.variant
        b1, b2, eps = tr["beta1"], tr["beta2"], tr["adam_eps"]
        if var == "betas_swapped":
            b1, b2 = b2, b1
        self.t += 1
        t = self.t + 1 if var == "bias_correction_next" else self.t
        bc1, bc2 = 1 - b1 ** t, 1 - b2 ** t
        if var == "no_bias_correction":
            bc1 = bc2 = 1.0
        for name, p in self.named:
            g = p.grad
            wd = tr["weight_decay"] if (p.dim() == 2 or var == "wd_all") \
                else 0.0
            if var == "wd_none":
                wd = 0.0
            decay = 1 - lr * wd
            if var == "wd_base_lr":
                decay = 1 - tr["lr"] * wd
            elif var == "wd_no_lr":
                decay = 1 - wd
            if var == "wd_l2":
                g = g + wd * p
            elif var != "wd_after":
                p.mul_(decay)
            m = self.m[name].mul_(b1).add_(g, alpha=1 - b1)
            v = self.v[name].mul_(b2).addcmul_(g, g, value=1 - b2)
            if var == "eps_inside_sqrt":
                p.addcdiv_(m, (v / bc2 + eps).sqrt(), value=-lr / bc1)
            elif var == "eps_unscaled":
                p.addcdiv_(m, v.sqrt() + eps,
                           value=-lr * math.sqrt(bc2) / bc1)
            else:
                p.addcdiv_(m, v.sqrt() / math.sqrt(bc2) + eps,
                           value=-lr / bc1)
            if var == "wd_after":
                p.mul_(decay)


def train_loop(names, P, batches, train, loss_of, variant=None):
    """Trains the leaves P[name] on `batches` (a list of steps, each a list
    of micro-batches (tokens, lengths, labels)).

    variant None: torch.optim.AdamW + LambdaLR + clip_grad_norm_.
    variant "" or a VARIANTS key: ManualAdamW and hand-written schedule and
    clipping, with that deviation.
    Returns (per-step records, final parameters as numpy arrays).
    """
    params = [P[n] for n in names]
    accum, clip, W = train["accum_steps"], train["clip_norm"], \
        train["warmup_steps"]
    if variant is None:
        groups = [
            {"params": [p for p in params if p.dim() == 2],
             "weight_decay": train["weight_decay"]},
            {"params": [p for p in params if p.dim() != 2],
             "weight_decay": 0.0}]
        opt = torch.optim.AdamW(
            [g for g in groups if g["params"]], lr=train["lr"],
            betas=(train["beta1"], train["beta2"]), eps=train["adam_eps"],
            foreach=False)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda t: schedule_factor(t + 1, W))
    else:
        opt = ManualAdamW([(n, P[n]) for n in names], train, variant)

    records = []
    for n, micro in enumerate(batches, start=1):
        for p in params:
            p.grad = None
        loss_sum = 0.0
        for tokens, lengths, labels in micro:
            loss_m = loss_of(P, tokens, lengths, labels)
            scaled = loss_m if variant == "grad_sum" else loss_m / accum
            scaled.backward()
            loss_sum += float(loss_m)
        for p in params:  # teo updates every parameter, used or not
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in params]

        if variant is None:
            if clip > 0:
                total = float(torch.nn.utils.clip_grad_norm_(params, clip))
            else:
                total = float(torch.norm(torch.stack(
                    [torch.norm(g) for g in grads])))
            coef = min(clip / (total + CLIP_EPS), 1.0) if clip > 0 else 1.0
            lr = opt.param_groups[0]["lr"]
            opt.step()
            sched.step()
        else:
            total = math.sqrt(sum(float((g * g).sum()) for g in grads))
            coef = 1.0
            if clip > 0 and variant != "clip_off":
                coef = clip / (total + (0.0 if variant == "clip_no_eps"
                                        else CLIP_EPS))
                if variant != "clip_always":
                    coef = min(coef, 1.0)
                for g in grads:
                    g.mul_(coef)
            k = {"lr_next": n + 1, "lr_prev": n - 1}.get(variant, n)
            factor = 1.0 if variant == "lr_const" else (
                schedule_factor(k, W) if k >= 1 else 0.0)
            lr = train["lr"] * factor
            opt.step(lr)
        records.append({"loss": loss_sum / accum, "lr": lr,
                        "grad_norm": total, "clipped": coef < 1.0})
    final = {n: P[n].detach().numpy().copy() for n in names}
    return records, final


def replay(trace, variant=None):
    cfg = trace["cfg"]
    names = tb.param_names(cfg)
    P = {n: torch.from_numpy(trace["init"][n].copy()).requires_grad_(True)
         for n in names}
    return train_loop(names, P, trace["batches"], trace["train"],
                      Model(cfg).loss, variant)


# ---------------------------------------------------------------------------
# Comparison
# ---------------------------------------------------------------------------

def rel(a, b):
    """|a - b| / |b| (inf when b = 0 and a != b; NaN stays NaN)."""
    d = abs(a - b)
    if d == 0:
        return 0.0
    return d / abs(b) if b != 0 else math.inf


def param_errors(final_torch, final_teo):
    """name -> (err, scale, err / (rtol * scale)), in canonical order."""
    out = {}
    for name, ref in final_teo.items():
        ours = final_torch[name]
        err = float(np.max(np.abs(ours - ref))) if ref.size else 0.0
        if ref.size and not (np.isfinite(ours).all()
                             and np.isfinite(ref).all()):
            err = math.inf
        scale = max(float(np.max(np.abs(ref))) if ref.size else 0.0,
                    PARAM_SCALE_FLOOR)
        out[name] = (err, scale, err / (RTOL_PARAM * scale))
    return out


def score(trace, records, final):
    """The worst error in units of its bound, over everything checked."""
    worst = 0.0
    for rec, teo in zip(records, trace["teo"]):
        for q, rtol in (("loss", RTOL_LOSS), ("lr", RTOL_LR),
                        ("grad_norm", RTOL_GRAD_NORM)):
            r = rel(rec[q], teo[q]) / rtol
            worst = max(worst, r) if r == r else math.inf
    for _, _, ratio in param_errors(final, trace["final"]).values():
        worst = max(worst, ratio) if ratio == ratio else math.inf
    return worst


def diagnose(trace):
    """Replays with each deviation and names those that fit the trace."""
    print("diagnosis: replaying with a hand-written AdamW under %d "
          "deviations ..." % len(VARIANTS))
    base = score(trace, *replay(trace, ""))
    print("  %-22s worst error / bound %.3g  (the hand-written AdamW "
          "without deviation)" % ("(none)", base))
    results = []
    for key in VARIANTS:
        try:
            s = score(trace, *replay(trace, key))
        except Exception as e:  # a deviation that breaks the arithmetic
            print("  %-22s failed: %s" % (key, e))
            continue
        results.append((s, key))
    results.sort()
    for s, key in results[:5]:
        print("  %-22s worst error / bound %.3g  %s" % (key, s,
                                                        VARIANTS[key]))
    fits = [key for s, key in results if s <= 1.0]
    if fits:
        print("diagnosis: the trace matches teo training with: %s"
              % "; ".join(VARIANTS[k] for k in fits))
    elif results and results[0][0] < base / 100:
        print("diagnosis: closest explanation (not exact): %s"
              % VARIANTS[results[0][1]])
    else:
        print("diagnosis: no listed deviation explains the trace")
    return fits


def first_divergence(records, trace, perrs):
    """Where the two runs part, and what that points at."""
    bounds = (("lr", RTOL_LR), ("loss", RTOL_LOSS),
              ("grad_norm", RTOL_GRAD_NORM))
    for n, (rec, teo) in enumerate(zip(records, trace["teo"]), start=1):
        bad = [q for q, rtol in bounds if not rel(rec[q], teo[q]) <= rtol]
        if not bad:
            continue
        if "lr" in bad:
            return ("step %d: the learning rate differs (teo %.17g, torch "
                    "%.17g): the schedule" % (n, teo["lr"], rec["lr"]))
        if "loss" in bad and n == 1:
            return ("step 1: the loss differs while the parameters are "
                    "still the initial ones: the forward pass, the loss, "
                    "or the micro-batch averaging")
        if "loss" in bad:
            return ("step %d: the loss differs after step %d matched: the "
                    "update of step %d (clipping or AdamW)" % (n, n - 1,
                                                                n - 1))
        return ("step %d: the loss matches but the pre-clipping gradient "
                "norm differs (ratio teo/torch %.17g): the backward pass "
                "or the gradient accumulation" % (
                    n, teo["grad_norm"] / rec["grad_norm"]
                    if rec["grad_norm"] else math.nan))
    bad = [k for k, v in perrs.items() if not v[2] <= 1.0]
    if bad:
        return ("every step's loss, lr and grad_norm match, but %d final "
                "parameter(s) differ (first %s): the last update (clipping "
                "or AdamW, which no later loss sees)" % (len(bad), bad[0]))
    return "no step or parameter differs"


def check(path, allow_no_clip=False, explain=True):
    trace = load_trace(path)
    cfg, train = trace["cfg"], trace["train"]
    print("trace %s: %d steps x %d micro-batches, d_model %d, %d layers, "
          "%s, lr %g, warmup %d, weight_decay %g, clip_norm %g"
          % (os.path.basename(path), trace["steps"], train["accum_steps"],
             cfg["d_model"], cfg["num_layers"],
             "pre-norm" if cfg["norm_first"] else "post-norm", train["lr"],
             train["warmup_steps"], train["weight_decay"],
             train["clip_norm"]))
    torch.set_num_threads(1)
    records, final = replay(trace)

    failures = []
    worst = {"loss": (0.0, 1), "lr": (0.0, 1), "grad_norm": (0.0, 1)}
    print("%5s  %-24s %-24s %-9s %-9s %-9s %s" % (
        "step", "teo loss", "torch loss", "rel", "lr rel", "gnorm rel",
        "clipped"))
    for n, (rec, teo) in enumerate(zip(records, trace["teo"]), start=1):
        rels = {q: rel(rec[q], teo[q]) for q in worst}
        print("%5d  %-24.17g %-24.17g %-9.2e %-9.2e %-9.2e %s" % (
            n, teo["loss"], rec["loss"], rels["loss"], rels["lr"],
            rels["grad_norm"], "yes" if rec["clipped"] else "no"))
        for q, rtol in (("loss", RTOL_LOSS), ("lr", RTOL_LR),
                        ("grad_norm", RTOL_GRAD_NORM)):
            r = rels[q]
            if r > worst[q][0] or r != r:
                worst[q] = (r, n)
            if not r <= rtol:
                failures.append(
                    "step %d: %s teo %.17g torch %.17g (rel %.3g > %g)%s"
                    % (n, q, teo[q], rec[q], r, rtol,
                       "  ratio teo/torch %.17g" % (teo[q] / rec[q])
                       if rec[q] else ""))

    perrs = param_errors(final, trace["final"])
    wname = max(perrs, key=lambda k: (perrs[k][2] != perrs[k][2],
                                      perrs[k][2]))
    for name, (err, scale, ratio) in perrs.items():
        if not ratio <= 1.0:
            failures.append("final %s: max|torch - teo| %.3g > %g * %.3g"
                            % (name, err, RTOL_PARAM, scale))
    clipped = sum(r["clipped"] for r in records)

    print("max rel loss diff %.3g (step %d), lr %.3g (step %d), grad_norm "
          "%.3g (step %d)" % (worst["loss"][0], worst["loss"][1],
                              worst["lr"][0], worst["lr"][1],
                              worst["grad_norm"][0], worst["grad_norm"][1]))
    err, scale, ratio = perrs[wname]
    print("worst parameter: %s, max|torch - teo| %.3g, relative to %.3g: "
          "%.3g (bound %g)" % (wname, err, scale, err / scale, RTOL_PARAM))
    print("clipped steps: %d of %d (clip_norm %g)"
          % (clipped, len(records), train["clip_norm"]))
    if clipped == 0 and not allow_no_clip:
        failures.append("no step was clipped (clip_norm %g), so the run "
                        "does not exercise clipping" % train["clip_norm"])

    if failures:
        bad_params = [f for f in failures if f.startswith("final ")]
        print("FAIL: %d mismatch(es); first: %s"
              % (len(failures), failures[0]))
        for f in failures[1:12]:
            print("  " + f)
        if len(failures) > 12:
            print("  ... and %d more" % (len(failures) - 12))
        if bad_params:
            dims = {}
            for name in perrs:
                if perrs[name][2] > 1.0:
                    dims.setdefault(len(trace["final"][name].shape),
                                    []).append(name)
            print("failing parameters by rank: %s" % ", ".join(
                "%d-D: %d of %d" % (d, len(v), sum(
                    1 for a in trace["final"].values() if a.ndim == d))
                for d, v in sorted(dims.items())))
        print("hint: %s" % first_divergence(records, trace, perrs))
        if explain and any(not f.startswith("no step") for f in failures):
            diagnose(trace)
        return 1
    print("PASS: teo's training matches PyTorch AdamW to the bounds "
          "(loss/grad_norm %g, lr %g, parameters %g)"
          % (RTOL_LOSS, RTOL_LR, RTOL_PARAM))
    return 0


# ---------------------------------------------------------------------------
# Self-test: traces from an independent PyTorch model and training loop
# ---------------------------------------------------------------------------

FAKE_CFG = {"vocab_size": 30, "max_len": 14, "d_model": 32, "num_heads": 4,
            "d_ff": 64, "num_layers": 2, "num_classes": 5,
            "norm_first": True, "activation": "gelu",
            "layer_norm_eps": 1e-5, "positional": "sinusoidal",
            "embed_scale": False, "pooling": "mean", "dropout": 0.0,
            "label_smoothing": 0.1, "causal": False}
FAKE_TRAIN = {"lr": 0.003, "warmup_steps": 5, "weight_decay": 0.01,
              "beta1": 0.9, "beta2": 0.999, "adam_eps": 1e-8,
              "clip_norm": 0.5, "accum_steps": 2, "batch_size": 16,
              "dtype": "float64"}


def fake_loss(cfg):
    """The same model as torch_backend's, written independently with
    F.multi_head_attention_forward and a masked-sum mean pooling."""
    D, H = cfg["d_model"], cfg["num_heads"]
    assert cfg["norm_first"] and cfg["pooling"] == "mean" \
        and cfg["positional"] == "sinusoidal" and not cfg["causal"]

    def table(S):
        pos = np.arange(S, dtype=np.float64)[:, None]
        two_i = (np.arange(D) // 2 * 2).astype(np.float64)
        angle = pos / np.power(10000.0, two_i / D)
        pe = np.where(np.arange(D) % 2 == 0, np.sin(angle), np.cos(angle))
        return torch.from_numpy(pe)

    def loss(P, tokens, lengths, labels):
        B, S = tokens.shape
        eps = cfg["layer_norm_eps"]
        pad = torch.arange(S)[None, :] >= lengths[:, None]
        x = F.embedding(tokens, P["embedding.weight"]) + table(S)
        for i in range(cfg["num_layers"]):
            p = "layers.%d." % i
            h = F.layer_norm(x, (D,), P[p + "norm1.weight"],
                             P[p + "norm1.bias"], eps).transpose(0, 1)
            a, _ = F.multi_head_attention_forward(
                h, h, h, D, H,
                torch.cat([P[p + "attn.%s.weight" % c] for c in "qkv"]),
                torch.cat([P[p + "attn.%s.bias" % c] for c in "qkv"]),
                None, None, False, 0.0, P[p + "attn.o.weight"],
                P[p + "attn.o.bias"], training=True, key_padding_mask=pad,
                need_weights=False)
            x = x + a.transpose(0, 1)
            h = F.layer_norm(x, (D,), P[p + "norm2.weight"],
                             P[p + "norm2.bias"], eps)
            h = F.linear(F.gelu(F.linear(h, P[p + "ffn.fc1.weight"],
                                         P[p + "ffn.fc1.bias"])),
                         P[p + "ffn.fc2.weight"], P[p + "ffn.fc2.bias"])
            x = x + h
        x = F.layer_norm(x, (D,), P["final_norm.weight"],
                         P["final_norm.bias"], eps)
        real = (~pad)[:, :, None].to(x.dtype)
        pooled = (x * real).sum(dim=1) / lengths[:, None].to(x.dtype)
        logits = F.linear(pooled, P["head.weight"], P["head.bias"])
        return F.cross_entropy(logits, labels,
                               label_smoothing=cfg["label_smoothing"])
    return loss


def write_fake_trace(path, steps=12, seed=1, variant="", train=None):
    cfg, train = dict(FAKE_CFG), dict(train or FAKE_TRAIN)
    rng = np.random.default_rng(seed)
    shapes = param_shapes(cfg)
    init = {}
    for name, shape in shapes.items():
        if "norm" in name:
            init[name] = (np.ones if name.endswith("weight")
                          else np.zeros)(shape)
            continue
        bound = math.sqrt(3.0) if "embedding" in name else \
            1 / math.sqrt(cfg["d_ff"] if name.endswith("fc2.weight")
                          or name.endswith("fc2.bias") else cfg["d_model"])
        init[name] = rng.uniform(-bound, bound, shape)
    batches = []
    for _ in range(steps):
        micro = []
        for _ in range(train["accum_steps"]):
            b = int(rng.choice([train["batch_size"], 7]))
            lengths = rng.integers(1, cfg["max_len"] + 1, b)
            S = int(lengths.max())
            tokens = rng.integers(0, cfg["vocab_size"], (b, S))
            labels = rng.integers(0, cfg["num_classes"], b)
            micro.append(tuple(torch.from_numpy(a.astype(np.int64))
                               for a in (tokens, lengths, labels)))
        batches.append(micro)
    names = list(shapes)
    P = {n: torch.from_numpy(init[n].copy()).requires_grad_(True)
         for n in names}
    records, final = train_loop(names, P, batches, train, fake_loss(cfg),
                                variant)
    out = {"init." + n: init[n] for n in names}
    for n, (micro, rec) in enumerate(zip(batches, records), start=1):
        for m, (tokens, lengths, labels) in enumerate(micro):
            out["step.%d.%d.tokens" % (n, m)] = tokens.numpy()
            out["step.%d.%d.lengths" % (n, m)] = lengths.numpy()
            out["step.%d.%d.labels" % (n, m)] = labels.numpy()
        for q in ("loss", "lr", "grad_norm"):
            out["step.%d.%s" % (n, q)] = np.array(rec[q], dtype=np.float64)
    out.update({"final." + n: final[n] for n in names})
    tb.st_write(path, out, {"format": FORMAT, "config": json.dumps(cfg),
                            "train": json.dumps(train), "steps": str(steps)})
    return sum(r["clipped"] for r in records)


def perturbed(src, dst, name, rel_amount, meta_update=None):
    tensors, meta = tb.st_read(src)
    a = tensors[name].copy()
    flat = a.reshape(-1)
    scale = max(float(np.max(np.abs(flat))), PARAM_SCALE_FLOOR)
    if a.ndim == 0:
        flat[0] = flat[0] * (1 + rel_amount)
    else:
        flat[flat.size // 2] += rel_amount * scale
    tensors[name] = a
    if meta_update:
        for key, patch in meta_update.items():
            value = json.loads(meta[key])
            value.update(patch)
            meta[key] = json.dumps(value)
    tb.st_write(dst, tensors, meta)


def run_quietly(argv):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        status = main(argv)
    return status, buf.getvalue()


def self_test():
    torch.set_num_threads(1)
    problems = []
    with tempfile.TemporaryDirectory() as tmp:
        good = os.path.join(tmp, "good.safetensors")
        clipped = write_fake_trace(good)
        print("fake trace: %d steps clipped of 12" % clipped)

        def expect(label, path, want, needle=None, extra=()):
            status, text = run_quietly([path] + list(extra))
            ok = status == want and (needle is None or needle in text)
            tail = [ln for ln in text.splitlines() if ln.strip()][-3:]
            print("%-4s %-52s exit %d (want %d)" % (
                "ok" if ok else "BAD", label, status, want))
            for ln in tail:
                print("       | " + ln)
            if not ok:
                problems.append(label)

        expect("independent replay passes", good, 0)
        for label, name, amount in (
                ("loss of step 3 * (1 + 1e-8) fails", "step.3.loss", 1e-8),
                ("lr of step 2 * (1 + 1e-14) fails", "step.2.lr", 1e-14),
                ("grad_norm of step 7 * (1 + 1e-8) fails",
                 "step.7.grad_norm", 1e-8),
                ("final fc1.bias entry + 1e-8 * scale fails",
                 "final.layers.1.ffn.fc1.bias", 1e-8),
                ("final embedding entry + 1e-8 * scale fails",
                 "final.embedding.weight", 1e-8)):
            path = os.path.join(tmp, "p.safetensors")
            perturbed(good, path, name, amount)
            expect(label, path, 1, extra=["--no-diagnosis"])
        path = os.path.join(tmp, "f32.safetensors")
        perturbed(good, path, "step.1.loss", 0.0,
                  {"train": {"dtype": "float32"}})
        expect("float32 trace is refused", path, 2)
        path = os.path.join(tmp, "bad.safetensors")
        with open(path, "wb") as f:
            f.write(b"\x10\x00")
        expect("truncated file is bad input", path, 2)
        path = os.path.join(tmp, "noclip.safetensors")
        write_fake_trace(path, steps=4,
                         train=dict(FAKE_TRAIN, clip_norm=1e3))
        expect("no clipped step fails", path, 1, "does not exercise")
        expect("... unless --allow-no-clip", path, 0,
               extra=["--allow-no-clip"])
        path = os.path.join(tmp, "wd_all.safetensors")
        write_fake_trace(path, variant="wd_all")
        expect("decayed biases are caught and diagnosed", path, 1,
               "matches teo training with: weight decay applied to every")
        path = os.path.join(tmp, "lr_next.safetensors")
        write_fake_trace(path, variant="lr_next")
        expect("lr one step ahead is caught", path, 1, "step 1: lr")
    if problems:
        print("self-test FAILED: %s" % "; ".join(problems))
        return 1
    print("self-test passed")
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(
        description="Replay a teo training trace in PyTorch and check it.")
    ap.add_argument("trace", nargs="?", help="the --trace file of teo train")
    ap.add_argument("--allow-no-clip", action="store_true",
                    help="pass even if no step was clipped")
    ap.add_argument("--no-diagnosis", action="store_true",
                    help="on a mismatch, skip the replays with deviations")
    ap.add_argument("--self-test", action="store_true",
                    help="check this script on traces it writes itself")
    args = ap.parse_args(argv)
    if args.self_test:
        return self_test()
    if not args.trace:
        ap.print_usage(sys.stderr)
        print("error: TRACE is required", file=sys.stderr)
        return 2
    try:
        return check(args.trace, args.allow_no_clip, not args.no_diagnosis)
    except BadInput as e:
        print("error: %s: %s" % (args.trace, e), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
