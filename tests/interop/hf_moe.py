"""Hugging Face transformers' mixtures of experts, as they ship, against teo's goldens.

transformers 4.44.2 (the pinned one) has Mixtral and Qwen2-MoE; Qwen3-MoE, gpt-oss and
DeepSeek-V3, which it has not, run as hf_qwen3_moe.py's, hf_gpt_oss.py's and hf_deepseek_v3.py's
independent Qwen3MoeForCausalLM, GptOssForCausalLM and DeepseekV3ForCausalLM (written from the
Hugging Face modeling code's documented behaviour) from the same export. Three kinds of run:
  - the blocks: MixtralSparseMoeBlock and Qwen2MoeSparseMoeBlock, built from the op case's sizes
    with the op case's parameters copied in (each expert's Linear layers from the stacked
    param.experts.* tensors), run on input.x and backpropagated from grad.output.y, against the
    op cases moe_mixtral_f64, moe_qwen2_shared_gate_f64 and moe_mixtral_bf16;
  - the whole model: MixtralForCausalLM loaded with `from_pretrained` from
    `teo golden export --names hf-mixtral`, run on the golden's batch (its padding as the
    attention mask, its next tokens as the labels, output_router_logits on, so that the loss is
    the cross-entropy plus router_aux_loss_coef times the load-balancing loss, as teo's is), and
    backpropagated from that loss; its candidate holds the embeddings, the layers' outputs, each
    layer's router logits, routing and MoE output, the final norm, the logits, the aux loss, the
    loss and every parameter's gradient under the checkpoint's names (`teo golden check --names`);
  - one mutant each, which must fail at its tensor: Mixtral's w1 and w3 swapped (the expert's gate
    and up projections read from each other's tensors), Qwen2-MoE's shared expert without its
    sigmoid gate.
The routing (topk_ids, topk_weights) is not returned by transformers: the candidate's is
computed from the block's own router logits by the block's own three lines (softmax in float32,
topk, the renormalisation where the block does it). transformers computes that softmax in
float32 whatever the model's dtype, so a float64 model is judged by the float32 rule
(--precision fp32); at float64's own tolerance the block fails first at the routing weights and
the model at the first layer's router logits (its RMSNorm and its eager attention's softmax are
float32 too), which this script also asserts (a float32 step inside a float64 model is what the check must see).
Usage: python hf_moe.py --teo TEO --golden GOLDEN_DIR --work DIR
Without transformers it exits 77 (a skip), or 1 when CI=true.
"""

import argparse
import json
import os
import subprocess
import sys

try:
    import torch
    import torch.nn.functional as F
    import transformers
    from transformers import (MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig,
                              Qwen2MoeForCausalLM)
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
except ImportError as e:  # pragma: no cover - the environment decides
    print("transformers is not installed (%s): scripts/setup.sh --test installs it" % e)
    sys.exit(1 if os.environ.get("CI") == "true" else 77)

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_deepseek_v3  # noqa: E402
import hf_gpt_oss  # noqa: E402
import hf_qwen3_moe  # noqa: E402
from hf_models import DTYPES, export, write  # noqa: E402
from torch_backend import st_read  # noqa: E402


def routing(logits, k, renormalise, dtype):
    """The block's own routing from its router logits: softmax in float32, topk, the
    renormalisation where the block does it, the weights cast back to the model's dtype."""
    w = F.softmax(logits, dim=1, dtype=torch.float)
    w, ids = torch.topk(w, k, dim=-1)
    if renormalise:
        w = w / w.sum(dim=-1, keepdim=True)
    return ids.to(torch.int32), w.to(dtype)


def expert_layers(block, family):
    """(gate, up, down) Linear layers of each routed expert."""
    if family == "mixtral":
        return [(e.w1, e.w3, e.w2) for e in block.experts]
    return [(e.gate_proj, e.up_proj, e.down_proj) for e in block.experts]


def block_candidate(path, family, dtype, mutant=None):
    """The op case's candidate from transformers' block: outputs, routing and gradients."""
    tensors, meta = st_read(path)
    spec = json.loads(meta["spec"])
    D, E, k, Fe = spec["d_model"], spec["num_experts"], spec["num_experts_per_tok"], \
        spec["moe_d_ff"]
    dt = DTYPES[dtype]
    if family == "mixtral":
        block = MixtralSparseMoeBlock(MixtralConfig(
            hidden_size=D, intermediate_size=Fe, num_local_experts=E, num_experts_per_tok=k,
            router_jitter_noise=0.0))
        renormalise = True
    else:
        block = Qwen2MoeSparseMoeBlock(Qwen2MoeConfig(
            hidden_size=D, moe_intermediate_size=Fe, num_experts=E, num_experts_per_tok=k,
            shared_expert_intermediate_size=spec["shared_d_ff"],
            norm_topk_prob=spec["norm_topk_prob"]))
        renormalise = spec["norm_topk_prob"]
    block = block.to(dt)
    T = {n: torch.from_numpy(a.copy()) for n, a in tensors.items()}
    with torch.no_grad():
        block.gate.weight.copy_(T["param.gate.weight"])
        gate, up = T["param.experts.w_gate"], T["param.experts.w_up"]
        if mutant == "w1_w3_swapped":
            gate, up = up, gate
        for e, (g, u, d) in enumerate(expert_layers(block, family)):
            g.weight.copy_(gate[e])
            u.weight.copy_(up[e])
            d.weight.copy_(T["param.experts.w_down"][e])
        if family == "qwen2_moe":
            s = block.shared_expert
            s.gate_proj.weight.copy_(T["param.shared.gate.weight"])
            s.up_proj.weight.copy_(T["param.shared.fc1.weight"])
            s.down_proj.weight.copy_(T["param.shared.fc2.weight"])
            block.shared_expert_gate.weight.copy_(T["param.shared_gate.weight"])
    if mutant == "shared_gate_without_sigmoid":
        real_sigmoid = F.sigmoid
        F.sigmoid = lambda t: t  # the block's module-level F.sigmoid, for this run only
    x = T["input.x"].to(dt).requires_grad_(True)
    y, logits = block(x[None])
    if mutant == "shared_gate_without_sigmoid":
        F.sigmoid = real_sigmoid
    y = y[0]
    (y * T["grad.output.y"].to(dt)).sum().backward()
    ids, w = routing(logits, k, renormalise, dt)
    c = {"output.logits": logits, "output.topk_ids": ids, "output.topk_weights": w,
         "output.y": y, "grad.input.x": x.grad,
         "grad.param.gate.weight": block.gate.weight.grad}

    def grad(p):
        return p.grad if p.grad is not None else torch.zeros_like(p)  # an expert with no token
    layers = expert_layers(block, family)
    for name, j in (("w_gate", 0), ("w_up", 1), ("w_down", 2)):
        c["grad.param.experts." + name] = torch.stack([grad(ly[j].weight) for ly in layers])
    if family == "qwen2_moe":
        s = block.shared_expert
        c["grad.param.shared.gate.weight"] = s.gate_proj.weight.grad
        c["grad.param.shared.fc1.weight"] = s.up_proj.weight.grad
        c["grad.param.shared.fc2.weight"] = s.down_proj.weight.grad
        c["grad.param.shared_gate.weight"] = block.shared_expert_gate.weight.grad
    return c


def model_candidate(golden_path, model_dir, names, dtype, mutant=None):
    """The model case's candidate from MixtralForCausalLM or Qwen2MoeForCausalLM loaded from
    teo's export."""
    tensors, meta = st_read(golden_path)
    dt = DTYPES[dtype]
    mixtral = names == "hf-mixtral"
    cls = MixtralForCausalLM if mixtral else Qwen2MoeForCausalLM
    model = cls.from_pretrained(model_dir, torch_dtype=dt, attn_implementation="eager")
    model.train()  # the goldens have no dropout: train mode only keeps autograd as teo runs it
    cfg = model.config
    renormalise = True if mixtral else cfg.norm_topk_prob
    blocks = [layer.block_sparse_moe if mixtral else layer.mlp for layer in model.model.layers]
    if mutant == "w1_w3_swapped":
        with torch.no_grad():
            for b in blocks:
                for e in b.experts:
                    w1 = e.w1.weight.detach().clone()
                    e.w1.weight.copy_(e.w3.weight)
                    e.w3.weight.copy_(w1)
    tokens = torch.from_numpy(tensors["input.tokens"])
    lengths = tensors["input.lengths"]
    B, S = tokens.shape
    seen = {}

    def block_hook(i):
        def hook(m, a, out):
            if isinstance(out, tuple):  # an MoE block: its output and its router logits
                y, logits = out
                ids, w = routing(logits, cfg.num_experts_per_tok, renormalise, dt)
                p = "act.layers.%d.moe." % i
                seen[p + "logits"] = logits.reshape(B, S, -1)
                seen[p + "topk_ids"] = ids.reshape(B, S, -1)
                seen[p + "topk_weights"] = w.reshape(B, S, -1)
            else:  # a dense layer's MLP
                y = out
            seen["act.layers.%d.ffn_out" % i] = y
        return hook
    for i, (layer, b) in enumerate(zip(model.model.layers, blocks)):
        layer.register_forward_hook(
            lambda m, a, out, i=i: seen.__setitem__("act.layers.%d.output" % i, out[0]))
        b.register_forward_hook(block_hook(i))
    model.model.norm.register_forward_hook(
        lambda m, a, out: seen.__setitem__("act.final_norm", out))
    mask = torch.from_numpy((np.arange(S)[None, :] < lengths[:, None]).astype(np.int64))
    labels = tokens.masked_fill(mask == 0, -100)  # padding has no target; the model shifts
    if mutant == "shared_gate_without_sigmoid":
        real_sigmoid = F.sigmoid
        F.sigmoid = lambda t: t  # the blocks' module-level F.sigmoid, for this run only
    out = model(input_ids=tokens, attention_mask=mask, labels=labels, output_hidden_states=True,
                output_router_logits=True)
    if mutant == "shared_gate_without_sigmoid":
        F.sigmoid = real_sigmoid
    out.loss.backward()
    c = dict(seen)
    c["act.input"] = out.hidden_states[0]
    c["act.lm_logits"] = out.logits
    if "act.moe_aux_loss" in tensors:  # router_aux_loss_coef > 0
        c["act.moe_aux_loss"] = out.aux_loss
    c["act.loss"] = out.loss
    for name, p in model.named_parameters():
        c["grad." + name] = p.grad if p.grad is not None else torch.zeros_like(p)
    return c


def check(teo, golden, cand, work, names=None, precision=None):
    report = os.path.join(work, "report.json")
    cmd = [teo, "golden", "check", "--no-progress", "--golden", golden, "--candidate", cand,
           "--json", report]
    if names:
        cmd += ["--names", names]
    if precision:
        cmd += ["--precision", precision]
    r = subprocess.run(cmd, capture_output=True, text=True)
    with open(report) as f:
        case = json.load(f)["cases"][0]
    return r.returncode, case["first_divergence"] or None, case["passed"] + case["failed"], \
        case["ambiguous"], r.stdout, case["tensors"]


def unjudged(tensors):
    """What a correct run must not leave unjudged: every gradient of a parameter or input, and
    each tensor the transformers candidate supplies but the check did not judge."""
    return [t["name"] for t in tensors
            if t["status"] in ("not_checked", "ambiguous", "vacuous")
            and t["name"].startswith("grad.") and not t["name"].startswith("grad.act.")]


# (golden, what runs it, its dtype, --precision, the mutant, the first tensor that must fail)
RUNS = [
    ("ops/moe_mixtral_f64", "mixtral", "float64", "fp32", None, None),
    ("ops/moe_mixtral_f64", "mixtral", "float64", None, None, "output.topk_weights"),
    ("ops/moe_mixtral_f64", "mixtral", "float32", "fp32", None, None),
    ("ops/moe_mixtral_bf16", "mixtral", "bfloat16", None, None, None),
    ("ops/moe_mixtral_f64", "mixtral", "float64", "fp32", "w1_w3_swapped", "output.y"),
    ("ops/moe_qwen2_shared_gate_f64", "qwen2_moe", "float64", "fp32", None, None),
    ("ops/moe_qwen2_shared_gate_f64", "qwen2_moe", "float64", None, None, "output.topk_weights"),
    ("ops/moe_qwen2_shared_gate_f64", "qwen2_moe", "float32", "fp32", None, None),
    ("ops/moe_qwen2_shared_gate_f64", "qwen2_moe", "float64", "fp32",
     "shared_gate_without_sigmoid", "output.y"),
    ("moe_mixtral_f64", "hf-mixtral", "float64", "fp32", None, None),
    # its RMSNorm and its eager attention's softmax compute in float32 too: the first tensor of
    # the candidate after them is the router's logits
    ("moe_mixtral_f64", "hf-mixtral", "float64", None, None, "layers.0.moe.logits"),
    ("moe_mixtral_f64", "hf-mixtral", "float32", "fp32", None, None),
    ("moe_mixtral_f32", "hf-mixtral", "float32", None, None, None),
    ("bf16_moe_mixtral", "hf-mixtral", "bfloat16", None, None, None),
    ("moe_mixtral_f64", "hf-mixtral", "float64", "fp32", "w1_w3_swapped", "layers.0.ffn_out"),
    ("moe_qwen2_shared_f64", "hf-qwen2-moe", "float64", "fp32", None, None),
    ("moe_qwen2_shared_f64", "hf-qwen2-moe", "float32", "fp32", None, None),
    ("bf16_moe_qwen2", "hf-qwen2-moe", "bfloat16", None, None, None),
    # layer 0 is dense (decoder_sparse_step 2): the first MoE output is layer 1's
    ("moe_qwen2_shared_f64", "hf-qwen2-moe", "float64", "fp32", "shared_gate_without_sigmoid",
     "layers.1.ffn_out"),
    # Qwen3-MoE: q and k normalised per head, heads of head_dim apart from hidden_size
    ("moe_qwen3_qk_norm_f64", "hf-qwen3-moe", "float64", "fp32", None, None),
    # its q_norm is a float32 RMSNorm: the first tensor at float64's own tolerance
    ("moe_qwen3_qk_norm_f64", "hf-qwen3-moe", "float64", None, None, "layers.0.q_norm"),
    ("moe_qwen3_qk_norm_f64", "hf-qwen3-moe", "float32", "fp32", None, None),
    ("moe_qwen3_qk_norm_f64", "hf-qwen3-moe", "float64", "fp32", "k_norm_weight_from_q",
     "layers.0.k_norm"),
    ("moe_qwen3_qk_norm_f64", "hf-qwen3-moe", "float64", "fp32", "rope_before_qk_norm",
     "layers.0.q_norm"),
    # gpt-oss: alternating windowed and full layers, sinks, fractional YaRN, interleaved experts
    ("moe_gpt_oss_layers_f64", "hf-gpt-oss", "float64", "fp32", None, None),
    ("moe_gpt_oss_layers_f64", "hf-gpt-oss", "float32", "fp32", None, None),
    ("moe_gpt_oss_layers_f64", "hf-gpt-oss", "float64", "fp32", "gate_up_halves",
     "layers.0.ffn_out"),
    # its RMSNorm and RoPE angles are float32: q_rot is the first tensor at float64's tolerance
    ("moe_gpt_oss_layers_f64", "hf-gpt-oss", "float64", None, None, "layers.0.q_rot"),
    ("moe_gpt_oss_layers_f64", "hf-gpt-oss", "float64", "fp32", "window_on_every_layer",
     "layers.1.context"),
    ("moe_gpt_oss_layers_f64", "hf-gpt-oss", "float64", "fp32", "yarn_truncated",
     "layers.0.q_rot"),
    # DeepSeek-V3: latent attention with YaRN's mscale, a dense layer, grouped sigmoid routing
    ("moe_deepseek_v3_mla_f64", "hf-deepseek-v3", "float64", "fp32", None, None),
    ("moe_deepseek_v3_mla_f64", "hf-deepseek-v3", "float32", "fp32", None, None),
    # its RMSNorms are float32: the input norm's, not a candidate tensor, shows first in q_a
    ("moe_deepseek_v3_mla_f64", "hf-deepseek-v3", "float64", None, None, "layers.0.q_a"),
    ("moe_deepseek_v3_mla_f64", "hf-deepseek-v3", "float64", "fp32", "mscale_ignored",
     "layers.0.context"),
    ("moe_deepseek_v3_mla_f64", "hf-deepseek-v3", "float64", "fp32", "attention_factor_ignored",
     "layers.0.q_rot"),
    ("moe_deepseek_v3_mla_f64", "hf-deepseek-v3", "float64", "fp32", "rope_on_nope_dims",
     "layers.0.q_rot"),
    ("moe_deepseek_v3_mla_f64", "hf-deepseek-v3", "float64", "fp32", "kv_b_split_swapped",
     "layers.0.k"),
]


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--teo", required=True)
    ap.add_argument("--golden", required=True)
    ap.add_argument("--work", required=True)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    print("transformers %s, torch %s" % (transformers.__version__, torch.__version__))
    failures = 0
    for case, runner, dtype, precision, mutant, expected in RUNS:
        golden = os.path.join(args.golden, case + ".safetensors")
        work = os.path.join(args.work, "%s_%s_%s_%s" % (case.replace("/", "_"), dtype,
                                                        precision or "own", mutant or "none"))
        cand = os.path.join(work, "candidate.safetensors")
        names = None
        if runner.startswith("hf-"):
            names = runner
            model = os.path.join(work, "model")
            export(args.teo, golden, model, names)
            independent = {"hf-qwen3-moe": hf_qwen3_moe, "hf-gpt-oss": hf_gpt_oss,
                           "hf-deepseek-v3": hf_deepseek_v3}
            if names in independent:
                write(independent[names].candidate(model, st_read(golden)[0], DTYPES[dtype],
                                                   mutant), cand)
            else:
                write(model_candidate(golden, model, names, dtype, mutant), cand)
        else:
            os.makedirs(work, exist_ok=True)
            write(block_candidate(golden, runner, dtype, mutant), cand)
        code, first, checked, ambiguous, text, tensors = check(args.teo, golden, cand, work,
                                                               names, precision)
        # the blocks' logits, routing, y and gradients; the model's every layer and gradient
        # (past a mutant's wrong layer, a later layer's routing may be ambiguous: its logits are
        # wrong too, which widens their tolerance; the mutant has already failed)
        enough = checked + ambiguous >= (8 if case.startswith("ops/") else 30)
        # a correct run: no routing left ambiguous, and every parameter's gradient judged (an
        # expert's missing slice would leave its stack not checked)
        missing = unjudged(tensors) if expected is None else []
        ok = enough and ((code == 0 and first is None and ambiguous == 0 and not missing)
                         if expected is None else (code == 1 and first == expected))
        failures += not ok
        print("%-31s %-10s %-8s %-5s %-27s exit %d, %2d checked, %d ambiguous, first divergence "
              "%-26s %s" % (case, runner, dtype, precision or "", mutant or "(correct)", code,
                            checked, ambiguous, first,
                            "ok" if ok else "FAIL: expected " + (expected or "a pass")))
        if not ok:
            print("not judged: %s" % ", ".join(missing) if missing else text)
    print("%d failure(s)" % failures)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
