"""DeepseekV3ForCausalLM, written independently in PyTorch from the Hugging Face modeling code's
documented behaviour (transformers 4.50 and later; the pinned 4.44.2 has no DeepSeek-V3), with the
weights unquantized (the released checkpoints' FP8 blocks are the quantized-weights issue's).

It loads what `teo golden export --names hf-deepseek-v3` writes (config.json and
model.safetensors) into modules that carry the checkpoint's own names, and runs as transformers'
eager CPU path does:
  - RMSNorm (every norm, q_a_layernorm and kv_a_layernorm included): the mean square and the
    scaling in float32, cast back, times the weight; the latent norms with RMSNorm's default eps
    1e-6 whatever rms_norm_eps says;
  - multi-head latent attention: q = q_b_proj(q_a_layernorm(q_a_proj(x))) (q_proj(x) without
    q_lora_rank) in heads of qk_nope_head_dim + qk_rope_head_dim, split into q_pass and q_rot;
    compressed_kv = kv_a_proj_with_mqa(x) split into the latent and k_rot; kv_b_proj of the
    normalised latent in heads of qk_nope_head_dim + v_head_dim, split into k_pass and the
    values; with rope_interleave q_rot and k_rot de-interleaved (pairs 2t, 2t + 1 to t and
    t + half) and rotated by rotate_half; k_rot, one head, expanded to every head; q k^T times
    qk_head_dim^-1/2 times yarn_get_mscale(factor, mscale_all_dim)^2 plus the causal and padding
    mask; softmax in float32, cast back; times v; o_proj;
  - RoPE over qk_rope_head_dim: modeling_rope_utils' YaRN, whose factor is
    max_position_embeddings / original_max_position_embeddings when the latter is given (the
    softmax scale above reads rope_scaling's own factor), inv_freq and the angles in float32,
    cos and sin times the attention factor get_mscale(f, mscale) / get_mscale(f, mscale_all_dim);
  - the first first_k_dense_replace layers a dense MLP of intermediate_size; the others the MoE
    block: router logits in float32, sigmoid scores, the correction bias added for the choice,
    each of n_group groups scored by the sum of its top 2, the top topk_group groups kept (the
    others' choice scores set to 0.0, as transformers masks them), the top k of the choice scores,
    their sigmoid scores as the weights, renormalised (+1e-20) with norm_topk_prob and times
    routed_scaling_factor; each expert's down(silu(gate(x)) * up(x)) times its weight, added
    expert by expert into a float32 sum (index_add_), cast back; plus the shared experts' MLP of
    n_shared_experts * moe_intermediate_size;
  - the loss: the logits in float32, the next token's cross-entropy over the unpadded positions
    (DeepSeek-V3 has no auxiliary loss in transformers).
The candidate's tensors are those of hf_moe.py's model runs plus each layer's q_a, q_a_norm, q,
kv_a, kv_norm, k, v, q_rot, k_rot (re-interleaved into teo's layout) and context; the routing
ids are sorted by their choice score, descending, ties to the lower index, as teo's are. Mutants:
  - mscale_ignored: the softmax scale without YaRN's mscale_all_dim factor;
  - attention_factor_ignored: cos and sin without YaRN's attention factor m(mscale) /
    m(mscale_all_dim);
  - rope_on_nope_dims: RoPE applied to each head's first qk_rope_head_dim dimensions;
  - kv_b_split_swapped: kv_b_proj's head read as [values | k_pass].
"""


import torch
import torch.nn as nn
import torch.nn.functional as F

import hf_causal_lm
from hf_causal_lm import MLP, RMSNorm, get_mscale, rotate_half


def deinterleave(x):
    """rope_interleave's layout: pairs (2t, 2t + 1) to (t, t + half)."""
    *lead, d = x.shape
    return x.reshape(*lead, d // 2, 2).transpose(-1, -2).reshape(*lead, d)


def reinterleave(x):
    """teo's interleaved layout of a rotated de-interleaved tail."""
    half = x.shape[-1] // 2
    return torch.stack((x[..., :half], x[..., half:]), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        D, self.H = c["hidden_size"], c["num_attention_heads"]
        self.Rq, self.Rkv = c["q_lora_rank"], c["kv_lora_rank"]
        self.Dn, self.Dr, self.Dv = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
        self.Dh = self.Dn + self.Dr
        self.interleave = c["rope_interleave"]
        if self.Rq is None:
            self.q_proj = nn.Linear(D, self.H * self.Dh, bias=False)
        else:
            self.q_a_proj = nn.Linear(D, self.Rq, bias=False)
            self.q_a_layernorm = RMSNorm(self.Rq, 1e-6)  # RMSNorm's default, not rms_norm_eps
            self.q_b_proj = nn.Linear(self.Rq, self.H * self.Dh, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(D, self.Rkv + self.Dr, bias=False)
        self.kv_a_layernorm = RMSNorm(self.Rkv, 1e-6)
        self.kv_b_proj = nn.Linear(self.Rkv, self.H * (self.Dn + self.Dv), bias=False)
        self.o_proj = nn.Linear(self.H * self.Dv, D, bias=False)
        self.scaling = self.Dh ** -0.5
        sc = c.get("rope_scaling")
        self.mscale = 1.0  # the softmax scale's factor: rope_scaling's own factor
        if sc and sc.get("mscale_all_dim"):
            m = get_mscale(sc["factor"], sc["mscale_all_dim"])
            self.mscale = m * m

    def rope(self, x, cos, sin, mutant):
        """x (B, h, S, Dh) with its RoPE part rotated: q_rot (or k_rot) in teo's layout."""
        if mutant == "rope_on_nope_dims":
            keep, rot = x[..., self.Dr:], x[..., :self.Dr]
        else:
            keep, rot = x[..., :self.Dn], x[..., self.Dn:]
        r = deinterleave(rot) if self.interleave else rot
        r = r * cos + rotate_half(r) * sin
        r = reinterleave(r) if self.interleave else r
        return torch.cat((r, keep) if mutant == "rope_on_nope_dims" else (keep, r), dim=-1)

    def forward(self, x, cos, sin, mask, seen, p, mutant):
        B, S, _ = x.shape
        if self.Rq is None:
            q = self.q_proj(x)
        else:
            q_a = self.q_a_proj(x)
            q_a_norm = self.q_a_layernorm(q_a)
            seen.update({p + "q_a": q_a, p + "q_a_norm": q_a_norm})
            q = self.q_b_proj(q_a_norm)
        q = q.view(B, S, self.H, self.Dh).transpose(1, 2)
        kv_a = self.kv_a_proj_with_mqa(x)
        latent, k_pe = torch.split(kv_a, [self.Rkv, self.Dr], dim=-1)
        kv_norm = self.kv_a_layernorm(latent)
        kv = self.kv_b_proj(kv_norm).view(B, S, self.H, self.Dn + self.Dv).transpose(1, 2)
        if mutant == "kv_b_split_swapped":
            v, k_pass = torch.split(kv, [self.Dv, self.Dn], dim=-1)
        else:
            k_pass, v = torch.split(kv, [self.Dn, self.Dv], dim=-1)
        k = torch.cat((k_pass, k_pe[:, None].expand(B, self.H, S, self.Dr)), dim=-1)
        q_rot, k_rot = self.rope(q, cos, sin, mutant), self.rope(k, cos, sin, mutant)
        scale = self.scaling * (1.0 if mutant == "mscale_ignored" else self.mscale)
        w = torch.matmul(q_rot, k_rot.transpose(2, 3)) * scale + mask
        w = F.softmax(w, dim=-1, dtype=torch.float32).to(q_rot.dtype)
        context = torch.matmul(w, v).transpose(1, 2).reshape(B, S, self.H * self.Dv)
        seen.update({p + "q": q, p + "kv_a": kv_a, p + "kv_norm": kv_norm, p + "k": k,
                     p + "v": v, p + "q_rot": q_rot, p + "k_rot": k_rot, p + "context": context})
        return self.o_proj(context)


class TopkRouter(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.E, self.k = c["n_routed_experts"], c["num_experts_per_tok"]
        self.G, self.topk_group = c["n_group"], c["topk_group"]
        self.norm_topk_prob, self.scale = c["norm_topk_prob"], c["routed_scaling_factor"]
        self.weight = nn.Parameter(torch.empty(self.E, c["hidden_size"]))
        self.register_buffer("e_score_correction_bias", torch.zeros(self.E))

    def forward(self, x):
        logits = F.linear(x.to(torch.float32), self.weight.to(torch.float32))
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias.to(torch.float32)[None]
        groups = choice.view(-1, self.G, self.E // self.G).topk(2, dim=-1)[0].sum(dim=-1)
        keep = torch.topk(groups, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(groups).scatter_(1, keep, 1)
        expert_mask = group_mask[:, :, None].expand(-1, self.G, self.E // self.G)
        choice = choice.masked_fill(~expert_mask.reshape(-1, self.E).bool(), 0.0)
        ids = torch.topk(choice, k=self.k, dim=-1, sorted=False)[1]
        # teo's order: descending choice score, ties to the lower index
        picked = choice.gather(1, ids)
        order = torch.argsort(ids, dim=-1)
        ids, picked = ids.gather(1, order), picked.gather(1, order)
        ids = ids.gather(1, torch.sort(-picked, dim=-1, stable=True)[1])
        w = scores.gather(1, ids)
        if self.norm_topk_prob:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return logits, ids, w * self.scale


class MoE(nn.Module):
    def __init__(self, c):
        super().__init__()
        D = c["hidden_size"]
        self.gate = TopkRouter(c)
        self.experts = nn.ModuleList(MLP(D, c["moe_intermediate_size"])
                                     for _ in range(c["n_routed_experts"]))
        self.shared_experts = MLP(D, c["moe_intermediate_size"] * c["n_shared_experts"])

    def forward(self, x):
        B, S, D = x.shape
        flat = x.reshape(-1, D)
        logits, ids, w = self.gate(flat)
        out = torch.zeros_like(flat, dtype=w.dtype)
        for e in range(len(self.experts)):
            tok, slot = torch.where(ids == e)
            if tok.numel() == 0:
                continue
            y = self.experts[e](flat[tok]) * w[tok, slot, None]
            out.index_add_(0, tok, y.to(out.dtype))
        y = out.to(x.dtype).reshape(B, S, D) + self.shared_experts(x)
        return y, logits, ids.to(torch.int32), w


class DecoderLayer(nn.Module):
    def __init__(self, c, i):
        super().__init__()
        D = c["hidden_size"]
        self.self_attn = Attention(c)
        self.input_layernorm = RMSNorm(D, c["rms_norm_eps"])
        self.post_attention_layernorm = RMSNorm(D, c["rms_norm_eps"])
        self.sparse = i >= c["first_k_dense_replace"]
        self.mlp = MoE(c) if self.sparse else MLP(D, c["intermediate_size"])


# DeepseekV3Config's defaults, for what save_pretrained may leave out
DEFAULTS = {"q_lora_rank": 1536, "rope_interleave": True, "rope_scaling": None,
            "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
            "n_shared_experts": 1, "norm_topk_prob": True, "n_group": 8, "topk_group": 4,
            "first_k_dense_replace": 3, "routed_scaling_factor": 2.5}


def load(model_dir, dtype):
    return hf_causal_lm.load(
        model_dir, dtype, lambda c: hf_causal_lm.ForCausalLM(c, DecoderLayer, RMSNorm), DEFAULTS)


def rope_tables(c, S, dtype, mutant=None):
    """cos and sin (S, Dr) as DeepseekV3RotaryEmbedding gives them, in the dtype."""
    inv, attention = hf_causal_lm.rope_inv_freq(c, c["qk_rope_head_dim"])
    if mutant == "attention_factor_ignored":
        attention = 1.0
    ang = torch.arange(S, dtype=torch.float32)[:, None] * inv[None, :]
    emb = torch.cat((ang, ang), dim=-1)
    return (emb.cos() * attention).to(dtype), (emb.sin() * attention).to(dtype)


def candidate(model_dir, tensors, dtype, mutant=None):
    """The model case's candidate (name -> tensor): its activations under teo's names, its
    parameters' gradients under the checkpoint's."""
    m = load(model_dir, dtype)
    c = m.c
    tokens, mask = hf_causal_lm.batch(tensors)
    B, S = tokens.shape
    cos, sin = rope_tables(c, S, dtype, mutant)
    visible = torch.tril(torch.ones(S, S, dtype=torch.bool))[None] & (mask[:, None, :] == 1)
    add = torch.zeros(B, 1, S, S, dtype=dtype).masked_fill(~visible[:, None],
                                                           torch.finfo(dtype).min)
    seen = {}
    h = m.model.embed_tokens(tokens)
    seen["act.input"] = h
    for i, layer in enumerate(m.model.layers):
        p = "act.layers.%d." % i
        h = h + layer.self_attn(layer.input_layernorm(h), cos, sin, add, seen, p, mutant)
        x = layer.post_attention_layernorm(h)
        if layer.sparse:
            y, logits, ids, w = layer.mlp(x)
            seen[p + "moe.logits"] = logits.reshape(B, S, -1)
            seen[p + "moe.topk_ids"] = ids.reshape(B, S, -1)
            seen[p + "moe.topk_weights"] = w.reshape(B, S, -1)
        else:
            y = layer.mlp(x)
        seen[p + "ffn_out"] = y
        h = h + y
        seen[p + "output"] = h
    h = m.model.norm(h)
    seen["act.final_norm"] = h
    logits = m.lm_head(h)
    return hf_causal_lm.finish(m, seen, logits, hf_causal_lm.lm_loss(logits, tokens, mask))
