"""Qwen3MoeForCausalLM, written independently in PyTorch from the Hugging Face modeling code's
documented behaviour (transformers 4.51 and later; the pinned 4.44.2 has no Qwen3-MoE).

It loads what `teo golden export --names hf-qwen3-moe` writes (config.json and model.safetensors)
into modules that carry the checkpoint's own names, and runs as transformers' eager path does:
  - RMSNorm (every norm, q_norm and k_norm included): the mean square and the scaling in float32,
    cast back to the model's dtype, then times the weight;
  - attention: q_proj, k_proj, v_proj (biases with attention_bias) into heads of head_dim (absent:
    hidden_size / num_attention_heads); q_norm and k_norm over each head's head_dim, then RoPE
    (rotate_half, the angles in float32, inv_freq from rope_theta); repeat_kv; q k^T times
    head_dim^-1/2 plus the causal and padding mask (the dtype's lowest value); softmax in float32,
    cast back; times v; heads merged into num_attention_heads * head_dim; o_proj;
  - the MoE block on every decoder_sparse_step-th layer not in mlp_only_layers: router logits
    gate(x); softmax in float32 over the experts; top-k; renormalised with norm_topk_prob; cast to
    the dtype; each expert's down(silu(gate(x)) * up(x)) times its weight, added expert by expert
    (index_add_); the other layers a dense MLP of intermediate_size;
  - the loss: the logits in float32, the next token's cross-entropy over the unpadded positions,
    plus router_aux_loss_coef times load_balancing_loss_func over the MoE layers' router logits
    (their softmax, the top-k one-hot counted per (token, slot), both averaged over the unmasked
    tokens, times the number of experts).
The candidate's tensors are those of hf_moe.py's model runs, plus each layer's q_norm, k_norm,
q_rot, k_rot and context, so that a bug in Qwen3's attention fails where it happens. Mutants:
  - k_norm_weight_from_q: k normalised with q_norm's weight;
  - rope_before_qk_norm: q and k rotated first, then normalised.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

import hf_causal_lm
from hf_causal_lm import MLP, RMSNorm, rotate_half


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        D, self.H, self.Hkv = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
        self.Dh = c.get("head_dim") or D // self.H
        bias = c["attention_bias"]
        self.q_proj = nn.Linear(D, self.H * self.Dh, bias=bias)
        self.k_proj = nn.Linear(D, self.Hkv * self.Dh, bias=bias)
        self.v_proj = nn.Linear(D, self.Hkv * self.Dh, bias=bias)
        self.o_proj = nn.Linear(self.H * self.Dh, D, bias=bias)
        self.q_norm = RMSNorm(self.Dh, c["rms_norm_eps"])
        self.k_norm = RMSNorm(self.Dh, c["rms_norm_eps"])

    def forward(self, x, cos, sin, mask, seen, p, mutant):
        B, S, _ = x.shape
        q = self.q_proj(x).view(B, S, self.H, self.Dh)
        k = self.k_proj(x).view(B, S, self.Hkv, self.Dh)
        v = self.v_proj(x).view(B, S, self.Hkv, self.Dh).transpose(1, 2)
        k_weight = self.q_norm.weight if mutant == "k_norm_weight_from_q" else None
        if mutant == "rope_before_qk_norm":
            qt, kt = q.transpose(1, 2), k.transpose(1, 2)
            q_rot = qt * cos + rotate_half(qt) * sin
            k_rot = kt * cos + rotate_half(kt) * sin
            q_norm, k_norm = self.q_norm(q_rot), self.k_norm(k_rot)
            q_att, k_att = q_norm, k_norm
        else:
            q_norm = self.q_norm(q).transpose(1, 2)
            k_norm = self.k_norm(k, k_weight).transpose(1, 2)
            q_rot = q_norm * cos + rotate_half(q_norm) * sin
            k_rot = k_norm * cos + rotate_half(k_norm) * sin
            q_att, k_att = q_rot, k_rot
        g = self.H // self.Hkv
        ka, va = k_att.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        w = torch.matmul(q_att, ka.transpose(2, 3)) * self.Dh ** -0.5 + mask
        w = F.softmax(w, dim=-1, dtype=torch.float32).to(q_att.dtype)
        context = torch.matmul(w, va).transpose(1, 2).reshape(B, S, self.H * self.Dh)
        seen.update({p + "q_norm": q_norm, p + "k_norm": k_norm, p + "q_rot": q_rot,
                     p + "k_rot": k_rot, p + "context": context})
        return self.o_proj(context)


class SparseMoeBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        D, self.E, self.k = c["hidden_size"], c["num_experts"], c["num_experts_per_tok"]
        self.norm_topk_prob = c["norm_topk_prob"]
        self.gate = nn.Linear(D, self.E, bias=False)
        self.experts = nn.ModuleList(MLP(D, c["moe_intermediate_size"]) for _ in range(self.E))

    def forward(self, x):
        B, S, D = x.shape
        x = x.reshape(-1, D)
        logits = self.gate(x)
        w = F.softmax(logits, dim=1, dtype=torch.float)
        w, ids = torch.topk(w, self.k, dim=-1)
        if self.norm_topk_prob:
            w = w / w.sum(dim=-1, keepdim=True)
        w = w.to(x.dtype)
        out = torch.zeros_like(x)
        for e in range(self.E):
            tok, slot = torch.where(ids == e)
            if tok.numel() == 0:
                continue
            y = self.experts[e](x[tok]) * w[tok, slot, None]
            out.index_add_(0, tok, y.to(x.dtype))
        return out.reshape(B, S, D), logits, ids.to(torch.int32), w


class DecoderLayer(nn.Module):
    def __init__(self, c, i):
        super().__init__()
        D = c["hidden_size"]
        self.self_attn = Attention(c)
        self.input_layernorm = RMSNorm(D, c["rms_norm_eps"])
        self.post_attention_layernorm = RMSNorm(D, c["rms_norm_eps"])
        self.sparse = i not in c["mlp_only_layers"] and c["num_experts"] > 0 and \
            (i + 1) % c["decoder_sparse_step"] == 0
        self.mlp = SparseMoeBlock(c) if self.sparse else MLP(D, c["intermediate_size"])


def defaults(c):
    """The config class's defaults for what save_pretrained may leave out."""
    d = {"attention_bias": False, "mlp_only_layers": [], "decoder_sparse_step": 1,
         "norm_topk_prob": False, "router_aux_loss_coef": 0.001, "rope_theta": 10000.0,
         "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "head_dim": None}
    d.update(c)
    if d.get("num_key_value_heads") is None:
        d["num_key_value_heads"] = d["num_attention_heads"]
    return d


def load(model_dir, dtype):
    return hf_causal_lm.load(
        model_dir, dtype, lambda c: hf_causal_lm.ForCausalLM(defaults(c), DecoderLayer, RMSNorm),
        {})


def load_balancing_loss(logits, E, k, mask):
    """load_balancing_loss_func with the attention mask: logits, the MoE layers' (B S, E) each."""
    cat = torch.cat(logits, dim=0)
    w = F.softmax(cat, dim=-1)
    _, sel = torch.topk(w, k, dim=-1)
    one_hot = F.one_hot(sel, E)
    B, S = mask.shape
    L = cat.shape[0] // (B * S)
    m_slot = mask[None, :, :, None, None].expand(L, B, S, k, E).reshape(-1, k, E)
    tokens_per_expert = (one_hot.float() * m_slot).sum(0) / m_slot.sum(0)
    m_tok = mask[None, :, :, None].expand(L, B, S, E).reshape(-1, E)
    prob_per_expert = (w * m_tok).sum(0) / m_tok.sum(0)
    return (tokens_per_expert * prob_per_expert[None]).sum() * E


def candidate(model_dir, tensors, dtype, mutant=None):
    """The model case's candidate (name -> tensor): its activations under teo's names, its
    parameters' gradients under the checkpoint's."""
    m = load(model_dir, dtype)
    c = m.c
    tokens, mask = hf_causal_lm.batch(tensors)
    B, S = tokens.shape
    seen = {}
    # RoPE: inv_freq and the angles in float32, cos and sin cast to the dtype
    Dh = m.model.layers[0].self_attn.Dh if c["num_hidden_layers"] else 1
    inv = 1.0 / (c["rope_theta"] ** (torch.arange(0, Dh, 2, dtype=torch.int64).float() / Dh))
    ang = torch.arange(S, dtype=torch.float32)[:, None] * inv[None, :]
    emb = torch.cat((ang, ang), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    # causal and padding: the dtype's lowest value where a key is not seen
    visible = torch.tril(torch.ones(S, S, dtype=torch.bool))[None] & (mask[:, None, :] == 1)
    lowest = torch.finfo(dtype).min
    add = torch.zeros(B, 1, S, S, dtype=dtype).masked_fill(~visible[:, None], lowest)
    h = m.model.embed_tokens(tokens)
    seen["act.input"] = h
    router_logits = []
    for i, layer in enumerate(m.model.layers):
        p = "act.layers.%d." % i
        attn = layer.self_attn(layer.input_layernorm(h), cos, sin, add, seen, p, mutant)
        h = h + attn
        x = layer.post_attention_layernorm(h)
        if layer.sparse:
            y, logits, ids, w = layer.mlp(x)
            router_logits.append(logits)
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
    loss = hf_causal_lm.lm_loss(logits, tokens, mask)
    if router_logits and "act.moe_aux_loss" in tensors:
        aux = load_balancing_loss(router_logits, c["num_experts"], c["num_experts_per_tok"],
                                  mask)
        seen["act.moe_aux_loss"] = aux
        loss = loss + (c["router_aux_loss_coef"] * aux).to(loss.dtype)  # HF's loss +=
    return hf_causal_lm.finish(m, seen, logits, loss)
