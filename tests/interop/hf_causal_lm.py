"""What hf_qwen3_moe.py's, hf_gpt_oss.py's and hf_deepseek_v3.py's independent Hugging Face
decoders share: the ForCausalLM skeleton under the checkpoint's names (model.embed_tokens,
model.layers, model.norm, lm_head), LlamaRMSNorm, rotate_half and the SwiGLU MLP, YaRN's
inv_freq as modeling_rope_utils computes it, loading an export into the skeleton, the golden's
batch, and the loss and gradients as ForCausalLMLoss computes them."""

import json
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file


class RMSNorm(nn.Module):
    """LlamaRMSNorm: the mean square and the scaling in float32, cast back, times the weight
    (`weight` in its place, for a mutant)."""

    def __init__(self, n, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x, weight=None):
        dt = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight if weight is None else weight) * h.to(dt)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class MLP(nn.Module):
    """down(silu(gate(x)) * up(x)), without biases."""

    def __init__(self, D, F_):
        super().__init__()
        self.gate_proj = nn.Linear(D, F_, bias=False)
        self.up_proj = nn.Linear(D, F_, bias=False)
        self.down_proj = nn.Linear(F_, D, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def get_mscale(scale, mscale=1.0):
    """modeling_rope_utils' get_mscale (DeepSeek's yarn_get_mscale)."""
    return 0.1 * mscale * math.log(scale) + 1.0 if scale > 1 else 1.0


def rope_inv_freq(c, dim, truncate=None):
    """inv_freq (dim / 2) in float32 and the attention factor on cos and sin, as
    modeling_rope_utils computes them for rope_scaling null, "default", "linear" and "yarn".
    transformers 4.50 to 4.57 take YaRN's factor as max_position_embeddings /
    original_max_position_embeddings whenever the latter is given; the correction range is
    floored and ceiled unless truncate is false (`truncate` in its place, for a mutant); the
    attention factor is get_mscale(f, mscale) / get_mscale(f, mscale_all_dim) with both set,
    else get_mscale(f)."""
    base, sc = c["rope_theta"], c.get("rope_scaling")
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    kind = sc.get("rope_type", sc.get("type")) if sc else None
    if kind in (None, "default"):
        return inv, 1.0
    factor = sc["factor"]
    if kind == "linear":
        return inv / factor, 1.0
    if kind != "yarn":
        raise ValueError("rope_scaling %r is not default, linear or yarn" % sc)
    orig = sc.get("original_max_position_embeddings")
    if orig is not None:
        factor = c["max_position_embeddings"] / orig
    else:
        orig = c["max_position_embeddings"]
    mscale, all_dim = sc.get("mscale"), sc.get("mscale_all_dim")
    attention = (get_mscale(factor, mscale) / get_mscale(factor, all_dim)
                 if mscale and all_dim else get_mscale(factor))

    def correction_dim(n):
        return (dim * math.log(orig / (n * 2 * math.pi))) / (2 * math.log(base))
    low = correction_dim(sc.get("beta_fast", 32.0))
    high = correction_dim(sc.get("beta_slow", 1.0))
    if sc.get("truncate", True) if truncate is None else truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    return (inv / factor) * (1 - extrapolation) + inv * extrapolation, attention


class Body(nn.Module):
    def __init__(self, c, layer, norm):
        super().__init__()
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = nn.ModuleList(layer(c, i) for i in range(c["num_hidden_layers"]))
        self.norm = norm(c["hidden_size"], c["rms_norm_eps"])


class ForCausalLM(nn.Module):
    """The model `layer(c, i)` decoder layers deep, its norms `norm(n, eps)`."""

    def __init__(self, c, layer, norm):
        super().__init__()
        self.c = c
        self.model = Body(c, layer, norm)
        self.lm_head = nn.Linear(c["hidden_size"], c["vocab_size"], bias=False)


def load(model_dir, dtype, make, defaults):
    """`make(config)` with config.json (over `defaults`), its weights from model.safetensors."""
    with open(os.path.join(model_dir, "config.json")) as f:
        c = dict(defaults, **json.load(f))
    m = make(c).to(dtype)
    state = {n: t.to(dtype) for n, t in
             load_file(os.path.join(model_dir, "model.safetensors")).items()}
    if c.get("tie_word_embeddings"):
        # one parameter: the LM head is the embedding, its gradient the sum of both uses
        m.lm_head.weight = m.model.embed_tokens.weight
        state.setdefault("lm_head.weight", state["model.embed_tokens.weight"])
    m.load_state_dict(state, strict=True)
    return m


def batch(tensors):
    """The golden's tokens (B, S) and attention mask (B, S), 1 on the real tokens."""
    tokens = torch.from_numpy(tensors["input.tokens"]).to(torch.long)
    lengths = torch.from_numpy(tensors["input.lengths"]).to(torch.long)
    S = tokens.shape[1]
    return tokens, (torch.arange(S)[None, :] < lengths[:, None]).to(torch.int64)


def lm_loss(logits, tokens, mask):
    """ForCausalLMLoss: the logits in float32, each real position's next token, the mean."""
    labels = tokens.masked_fill(mask == 0, -100)
    shift = F.pad(labels, (0, 1), value=-100)[:, 1:]
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), shift.reshape(-1),
                           ignore_index=-100)


def finish(m, seen, logits, loss):
    """Backpropagates the loss; the candidate: `seen`, the logits, the loss and every
    parameter's gradient under the checkpoint's name (zero where none reached it)."""
    loss.backward()
    out = dict(seen)
    out["act.lm_logits"] = logits
    out["act.loss"] = loss
    for name, prm in m.named_parameters():
        out["grad." + name] = prm.grad if prm.grad is not None else torch.zeros_like(prm)
    return out
