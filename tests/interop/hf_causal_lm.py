"""What hf_qwen3_moe.py's and hf_gpt_oss.py's independent Hugging Face decoders share: the
ForCausalLM skeleton under the checkpoint's names (model.embed_tokens, model.layers,
model.norm, lm_head), loading an export into it, the golden's batch, and the loss and gradients
as ForCausalLMLoss computes them."""

import json
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file


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
