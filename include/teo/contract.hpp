// The contract: every tensor of a model case, named once. Each entry has its golden name, its role,
// its dtype rule and its symbolic shape ("[B, Hkv, S, Dh]"); everything else that lists tensors
// derives from here: the parameter shapes (Params::zeros, validate_params), the activation shapes
// (validate_activations), the replayed dropout masks (ForwardOptions::masks), the generator's
// lists and --keep, the validation of a golden before it is read (golden::validate, which `teo
// golden list` and every reader run first), `teo shapes` and the tables of docs/golden-format.md
// (checked by a test).
//
// The names come from one place: Params::visit and Activations::visit, run on empty tensors, plus
// one table of symbolic shapes and one table of the order a layer uses its parameters.
#pragma once

#include <string>
#include <vector>

#include "teo/config.hpp"
#include "teo/types.hpp"

namespace teo::contract {

enum class Role {
  input,   // input.tokens, input.lengths, input.labels (an encoder's)
  param,   // param.<name>
  mask,    // dropout.<site>: U8, 1 = kept
  act,     // act.<name>: what forward computes
  grad,    // grad.<param> and grad.act.<name>: what backward computes
  ref64,   // ref64.<act or grad>: a float32 case's float64 twin
  packed,  // quant.<weight>.<role>: a quantized weight's stored tensors (its format's dtypes)
};
const char* to_string(Role r);

// Which dtype a tensor has: integer ids, masks, the case's float type, float64 in any case, or
// 32-bit integers (an MoE layer's routing and grouped layout).
// A packed tensor's dtype is its format's: i8, i32, f16, f32, u8 or f8_e4m3.
enum class DTypeRule { i64, u8, real, f64, i32, i8, f16, f32, f8_e4m3 };
const char* to_string(DTypeRule d);

// The sizes a model case adds to its config: steps > 0 for a generation case (a decoder's greedy
// steps after the prompt, docs/golden-format.md "Generation").
struct Sizes {
  index_t batch = 0;
  index_t seq_len = 0;  // an encoder_decoder's source length
  index_t steps = 0;
  index_t tgt_len = 0;  // an encoder_decoder's target length
  // a router replay case: each MoE layer's routing is an input, input.layers.{i}.moe.topk_ids
  bool routing_given = false;
};

// One tensor of the contract.
struct TensorSpec {
  std::string name;  // as in a golden file: "act.layers.0.k", "grad.head.bias"
  Role role = Role::act;
  DTypeRule dtype = DTypeRule::real;
  // Symbolic dimensions: B, S, D, H, Hkv, Dh, F, V, C, max_len, T (generation steps), and Hkv*Dh
  // for the key and value projections (Hkv = num_kv_heads, default H); Dv (v's head width, Dh but
  // under MLA), H*Dv, and MLA's Rq, Rkv, Rkv+Dr and H*(Dn+Dv). The number of each comes from dim().
  std::vector<std::string> dims;
  std::vector<index_t> shape;    // dims resolved for the case
  std::string symbolic() const;  // "[B, Hkv, S, Dh]", "[]" for a scalar
};

// The value of symbolic dimension `sym` under cfg and s; std::invalid_argument for an unknown one.
index_t dim(const std::string& sym, const ModelConfig& cfg, Sizes s);

// The symbolic dimensions `dims` resolved under cfg and s.
std::vector<index_t> shape(const std::vector<std::string>& dims, const ModelConfig& cfg, Sizes s);

// The symbolic shape of a parameter (without "param."), of an activation (without "act."), of a
// dropout site ("dropout.input", "dropout.layers.0.ffn") and of any golden name: "param.X",
// "act.X", "grad.X", "grad.act.X", "ref64.<any of those>", "input.X". std::invalid_argument when
// the name is none of the contract's.
std::vector<std::string> param_dims(const std::string& name);
std::vector<std::string> act_dims(const std::string& name);
std::vector<std::string> mask_dims(const std::string& site);
std::vector<std::string> dims_of(const std::string& golden_name);
std::string symbolic(const std::vector<std::string>& dims);

// The parameters present under cfg, in canonical order (Params::visit), named without "param.".
std::vector<TensorSpec> params(const ModelConfig& cfg);

// Every activation forward keeps under cfg, in pipeline order (Activations::visit), named without
// "act.". With `in_golden` (the default) it leaves out ffn_gate, ffn_pre and residual2, which the
// model keeps for backward but a golden does not hold.
std::vector<TensorSpec> activations(const ModelConfig& cfg, Sizes s, bool in_golden = true);

// The dropout sites of cfg ("dropout.input", "dropout.layers.{i}.attn", ...), whether or not
// dropout applies.
std::vector<TensorSpec> masks(const ModelConfig& cfg, Sizes s);

// The gradients a golden holds, in the order backward produces them: grad.act.logits, the head,
// grad.act.pooled (a decoder: grad.act.lm_logits, the LM head), the final norm, then from the last
// layer down its output's gradient and its parameters' (the reverse of the order forward uses
// them, weight before bias), grad.act.input and the embeddings. Every parameter has its
// grad.<name> but a quantized weight; a tied LM head's is in grad.embedding.weight.
std::vector<TensorSpec> gradients(const ModelConfig& cfg, Sizes s);

// Whether a golden tensor of a model under cfg is 0 in exact arithmetic, so that it holds nothing
// but the rounding noise of the sum that forms it: the key bias gradients
// grad.layers.{i}.attn.k.bias, where the key bias shifts a whole row of scores by q_i . b, which
// softmax ignores (so the sum over rows of dK is 0). Not so with RoPE (the bias is rotated by
// position), sinks (the sink's logit is not shifted) or a soft-cap (tanh does not keep a shift):
// there it is a real gradient.
bool noise_only(const std::string& golden_name, const ModelConfig& cfg);

// The tensors a generation case adds (none when s.steps is 0): the input input.generate.tokens
// (T, B), the token each sequence is fed at each step, and per step t the activation
// act.generate.{t}.logits (B, V), the logits after it.
std::vector<TensorSpec> generation(const ModelConfig& cfg, Sizes s);

// A weight that cfg's quantization stores packed (docs/quantization.md, "Quantized models"): its
// parameter's name and the matrix (rows, cols) it is, `lead` of them stacked (the experts', E).
struct QuantizedWeight {
  std::string name;
  index_t lead = 0, rows = 0, cols = 0;
};
// cfg's quantized weights in parameter order (none without quantization). ConfigError for a
// target glob that names no linear weight of the layers, or a weight its format cannot pack.
std::vector<QuantizedWeight> quantized(const ModelConfig& cfg);
// The linear weights of the layers a quantization may store packed (its targets' default), in
// parameter order, whether or not their shapes pack.
std::vector<std::string> quantizable(const ModelConfig& cfg);
// Whether parameter `name` (without "param.") is one of them.
bool is_quantized(const ModelConfig& cfg, const std::string& name);
// The packed tensors of cfg's quantized weights in parameter order, each weight's parts in its
// format's order (teo/weight_format.hpp): "quant." + quant::weight_part_name of the parameter,
// a stack's parts with E first.
std::vector<TensorSpec> packed(const ModelConfig& cfg);

// Every tensor of a model golden, in file order: the inputs (input.generate.tokens last), the
// parameters, the quantized weights' packed tensors, the dropout masks (when cfg.dropout > 0), the
// activations, the generation steps' logits, the gradients, and for a float32 case the ref64 twin
// of each activation, generation logits and gradient. Shapes resolved; dtype rules as stored (real
// means F32 in a float32 case, F64 in a float64 one).
std::vector<TensorSpec> model_case(const ModelConfig& cfg, Sizes s, bool float32);

}  // namespace teo::contract
