"""GptOssForCausalLM, written independently in PyTorch from the Hugging Face modeling code's
documented behaviour (transformers 4.55 and later; the pinned 4.44.2 has no gpt-oss), with the
experts dequantized (bf16 in transformers; the released checkpoints' MXFP4 blocks are the
quantized-weights issue's).

It loads what `teo golden export --names hf-gpt-oss` writes (config.json and model.safetensors)
into modules that carry the checkpoint's own names, and runs as transformers' eager CPU path does:
  - RMSNorm: the mean square and the scaling in float32, times the weight, cast back;
  - attention: q_proj, k_proj, v_proj and o_proj with biases, heads of head_dim; RoPE on the two
    halves of each head (cos and sin of head_dim / 2 angles, computed in float32 from inv_freq
    and times YaRN's attention factor, cast to the dtype); q k^T times head_dim^-1/2 plus the
    causal mask, windowed to the last sliding_window keys on a "sliding_attention" layer; each
    row's sink logit appended, the row's max subtracted, a softmax in the dtype, the sink's column
    dropped; times v; o_proj;
  - the MoE block of every layer: router logits from a Linear with bias; the top k logits
    softmaxed over those k; each chosen expert's gate_up = x gate_up_proj[e] + bias, gate the even
    columns and up the odd ones, gate clamped above at swiglu_limit, up to [-limit, limit],
    (up + 1) * gate * sigmoid(1.702 gate), then down_proj[e] plus its bias, times the weight,
    added expert by expert (index_add_);
  - the loss: the logits in float32, the next token's cross-entropy over the unpadded positions.
YaRN's inv_freq follows modeling_rope_utils: the factor max_position_embeddings /
original_max_position_embeddings (transformers 4.50 to 4.57 take that ratio whenever the latter is
given), the correction range from beta_fast and beta_slow over original_max_position_embeddings, floored and ceiled unless truncate is false, the linear
ramp, and the attention factor 0.1 ln(factor) + 1.
The candidate's tensors are those of hf_moe.py's model runs plus each layer's q_rot, k_rot,
context and attn_out. Mutants:
  - gate_up_halves: gate and up read as the two halves of gate_up_proj, not its even and odd
    columns;
  - window_on_every_layer: the sliding window applied on the full layers too;
  - yarn_truncated: YaRN's correction range floored and ceiled although truncate is false.
"""


import torch
import torch.nn as nn
import torch.nn.functional as F

import hf_causal_lm


class RMSNorm(nn.Module):
    def __init__(self, n, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        dt = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * h).to(dt)


def rotate(x, cos, sin):
    a, b = torch.chunk(x, 2, dim=-1)
    return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)


class Attention(nn.Module):
    def __init__(self, c, i):
        super().__init__()
        D, self.H, self.Hkv = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
        self.Dh = c["head_dim"]
        bias = c["attention_bias"]
        self.q_proj = nn.Linear(D, self.H * self.Dh, bias=bias)
        self.k_proj = nn.Linear(D, self.Hkv * self.Dh, bias=bias)
        self.v_proj = nn.Linear(D, self.Hkv * self.Dh, bias=bias)
        self.o_proj = nn.Linear(self.H * self.Dh, D, bias=bias)
        self.sinks = nn.Parameter(torch.empty(self.H))
        self.sliding = c["layer_types"][i] == "sliding_attention"

    def forward(self, x, cos, sin, mask, seen, p):
        B, S, _ = x.shape
        q = self.q_proj(x).view(B, S, self.H, self.Dh).transpose(1, 2)
        k = self.k_proj(x).view(B, S, self.Hkv, self.Dh).transpose(1, 2)
        v = self.v_proj(x).view(B, S, self.Hkv, self.Dh).transpose(1, 2)
        q_rot, k_rot = rotate(q, cos, sin), rotate(k, cos, sin)
        g = self.H // self.Hkv
        ka, va = k_rot.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        w = torch.matmul(q_rot, ka.transpose(2, 3)) * self.Dh ** -0.5 + mask
        sinks = self.sinks.reshape(1, -1, 1, 1).expand(B, -1, S, 1)
        both = torch.cat([w, sinks], dim=-1)
        both = both - both.max(dim=-1, keepdim=True).values
        probs = F.softmax(both, dim=-1, dtype=both.dtype)[..., :-1]
        context = torch.matmul(probs, va).transpose(1, 2).reshape(B, S, self.H * self.Dh)
        out = self.o_proj(context)
        seen.update({p + "q_rot": q_rot, p + "k_rot": k_rot, p + "context": context,
                     p + "attn_out": out})
        return out


class Router(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.k = c["num_experts_per_tok"]
        self.weight = nn.Parameter(torch.empty(c["num_local_experts"], c["hidden_size"]))
        self.bias = nn.Parameter(torch.empty(c["num_local_experts"]))

    def forward(self, x):
        logits = F.linear(x, self.weight, self.bias)
        top, ids = torch.topk(logits, self.k, dim=-1)
        top = F.softmax(top, dim=1, dtype=top.dtype)
        scores = torch.zeros_like(logits).scatter_(1, ids, top)
        return logits, scores, ids, top


class Experts(nn.Module):
    def __init__(self, c):
        super().__init__()
        E, D, Fe = c["num_local_experts"], c["hidden_size"], c["intermediate_size"]
        self.E, self.limit, self.alpha = E, c["swiglu_limit"], 1.702
        self.gate_up_proj = nn.Parameter(torch.empty(E, D, 2 * Fe))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(E, 2 * Fe))
        self.down_proj = nn.Parameter(torch.empty(E, Fe, D))
        self.down_proj_bias = nn.Parameter(torch.empty(E, D))

    def forward(self, x, ids, scores, mutant):
        out = torch.zeros_like(x)
        for e in range(self.E):
            tok, _ = torch.where(ids == e)
            if tok.numel() == 0:
                continue
            gate_up = x[tok] @ self.gate_up_proj[e] + self.gate_up_proj_bias[e]
            if mutant == "gate_up_halves":
                gate, up = torch.chunk(gate_up, 2, dim=-1)
            else:
                gate, up = gate_up[..., ::2], gate_up[..., 1::2]
            gate = gate.clamp(min=None, max=self.limit)
            up = up.clamp(min=-self.limit, max=self.limit)
            glu = gate * torch.sigmoid(gate * self.alpha)
            y = ((up + 1) * glu) @ self.down_proj[e] + self.down_proj_bias[e]
            out.index_add_(0, tok, (y * scores[tok, e, None]).to(x.dtype))
        return out


class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.router = Router(c)
        self.experts = Experts(c)


class DecoderLayer(nn.Module):
    def __init__(self, c, i):
        super().__init__()
        D = c["hidden_size"]
        self.self_attn = Attention(c, i)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(D, c["rms_norm_eps"])
        self.post_attention_layernorm = RMSNorm(D, c["rms_norm_eps"])


def load(model_dir, dtype):
    return hf_causal_lm.load(
        model_dir, dtype, lambda c: hf_causal_lm.ForCausalLM(c, DecoderLayer, RMSNorm),
        {"attention_bias": True, "swiglu_limit": 7.0, "tie_word_embeddings": False})


def candidate(model_dir, tensors, dtype, mutant=None):
    """The model case's candidate (name -> tensor): its activations under teo's names, its
    parameters' gradients under the checkpoint's."""
    m = load(model_dir, dtype)
    c = m.c
    tokens, mask = hf_causal_lm.batch(tensors)
    B, S = tokens.shape
    inv, attention_factor = hf_causal_lm.rope_inv_freq(
        c, c["head_dim"], True if mutant == "yarn_truncated" else None)
    ang = torch.arange(S, dtype=torch.float32)[:, None] * inv[None, :]
    cos = (ang.cos() * attention_factor).to(dtype)
    sin = (ang.sin() * attention_factor).to(dtype)
    i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
    causal = (j <= i)[None] & (mask[:, None, :] == 1)
    window = causal & (i - j < c["sliding_window"])[None]
    lowest = torch.finfo(dtype).min

    def additive(visible):
        return torch.zeros(B, 1, S, S, dtype=dtype).masked_fill(~visible[:, None], lowest)
    full_mask, sliding_mask = additive(causal), additive(window)
    seen = {}
    h = m.model.embed_tokens(tokens)
    seen["act.input"] = h
    for n, layer in enumerate(m.model.layers):
        p = "act.layers.%d." % n
        sliding = layer.self_attn.sliding or mutant == "window_on_every_layer"
        h = h + layer.self_attn(layer.input_layernorm(h), cos, sin,
                                sliding_mask if sliding else full_mask, seen, p)
        x = layer.post_attention_layernorm(h).reshape(-1, c["hidden_size"])
        logits, scores, ids, top = layer.mlp.router(x)
        y = layer.mlp.experts(x, ids, scores, mutant).reshape(B, S, -1)
        seen[p + "moe.logits"] = logits.reshape(B, S, -1)
        seen[p + "moe.topk_ids"] = ids.to(torch.int32).reshape(B, S, -1)
        seen[p + "moe.topk_weights"] = top.reshape(B, S, -1)
        seen[p + "ffn_out"] = y
        h = h + y
        seen[p + "output"] = h
    h = m.model.norm(h)
    seen["act.final_norm"] = h
    logits = m.lm_head(h)
    return hf_causal_lm.finish(m, seen, logits, hf_causal_lm.lm_loss(logits, tokens, mask))
