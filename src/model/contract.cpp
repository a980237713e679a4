#include "teo/contract.hpp"

#include <algorithm>
#include <initializer_list>
#include <map>
#include <set>
#include <stdexcept>
#include <string_view>

#include "teo/model.hpp"

namespace teo::contract {

namespace {

using Dims = std::vector<std::string>;

// A name of the form "layers.{i}.<rest>": <rest>, else the name itself.
std::string without_layer(const std::string& name) {
  if (!name.starts_with("layers.")) return name;
  const auto dot = name.find('.', 7);
  return dot == std::string::npos ? name : name.substr(dot + 1);
}

// The symbolic shape of every parameter, by its name within its layer (or at the top).
const std::map<std::string, Dims>& param_table() {
  static const std::map<std::string, Dims> t = {
      {"embedding.weight", {"V", "D"}},
      {"patch_embedding.weight", {"D", "Ch", "P", "P"}},
      {"patch_embedding.bias", {"D"}},
      {"cls_token", {"D"}},
      {"pos_embedding.weight", {"max_len", "D"}},
      {"token_type_embedding.weight", {"Tv", "D"}},
      {"embedding_norm.weight", {"D"}},
      {"embedding_norm.bias", {"D"}},
      {"pooler.weight", {"D", "D"}},
      {"pooler.bias", {"D"}},
      {"attn.q.weight", {"H*Dh", "D"}},
      {"attn.q.bias", {"H*Dh"}},
      {"attn.k.weight", {"Hkv*Dh", "D"}},
      {"attn.k.bias", {"Hkv*Dh"}},
      {"attn.v.weight", {"Hkv*Dh", "D"}},
      {"attn.v.bias", {"Hkv*Dh"}},
      {"attn.o.weight", {"D", "H*Dv"}},
      {"attn.o.bias", {"D"}},
      {"attn.sinks", {"H"}},
      {"attn.q_norm.weight", {"Dh"}},
      {"attn.k_norm.weight", {"Dh"}},
      {"attn.q_a.weight", {"Rq", "D"}},
      {"attn.q_a_norm.weight", {"Rq"}},
      {"attn.q_b.weight", {"H*Dh", "Rq"}},
      {"attn.kv_a.weight", {"Rkv+Dr", "D"}},
      {"attn.kv_norm.weight", {"Rkv"}},
      {"attn.kv_b.weight", {"H*(Dn+Dv)", "Rkv"}},
      {"norm1.weight", {"D"}},
      {"norm1.bias", {"D"}},
      {"norm2.weight", {"D"}},
      {"norm2.bias", {"D"}},
      {"ffn.gate.weight", {"F", "D"}},
      {"ffn.gate.bias", {"F"}},
      {"ffn.fc1.weight", {"F", "D"}},
      {"ffn.fc1.bias", {"F"}},
      {"ffn.fc2.weight", {"D", "F"}},
      {"ffn.fc2.bias", {"D"}},
      {"moe.gate.weight", {"E", "D"}},
      {"moe.gate.bias", {"E"}},
      {"moe.gate.e_score_correction_bias", {"E"}},
      {"moe.experts.w_gate", {"E", "Fe", "D"}},
      {"moe.experts.b_gate", {"E", "Fe"}},
      {"moe.experts.w_up", {"E", "Fe", "D"}},
      {"moe.experts.b_up", {"E", "Fe"}},
      {"moe.experts.w_down", {"E", "D", "Fe"}},
      {"moe.experts.b_down", {"E", "D"}},
      {"moe.shared.gate.weight", {"Fs", "D"}},
      {"moe.shared.fc1.weight", {"Fs", "D"}},
      {"moe.shared.fc2.weight", {"D", "Fs"}},
      {"moe.shared_gate.weight", {"1", "D"}},
      {"final_norm.weight", {"D"}},
      {"final_norm.bias", {"D"}},
      {"head.weight", {"C", "D"}},
      {"head.bias", {"C"}},
      {"lm_head.weight", {"Vt", "D"}},
      {"lm_head.bias", {"Vt"}},
      {"decoder.embedding.weight", {"Vt", "D"}},
      {"decoder.pos_embedding.weight", {"max_len", "D"}},
      {"decoder.final_norm.weight", {"D"}},
      {"decoder.final_norm.bias", {"D"}},
  };
  return t;
}

// An encoder_decoder's decoder layer's parameters, by name without "decoder.layers.{i}." (its
// FFN's are the encoder layer's).
const std::map<std::string, Dims>& decoder_param_table() {
  static const std::map<std::string, Dims> t = [] {
    std::map<std::string, Dims> m;
    for (const char* a : {"self_attn", "cross_attn"}) {
      const std::string b = std::string(a) + ".";
      m[b + "q.weight"] = {"D", "D"};
      m[b + "q.bias"] = {"D"};
      m[b + "k.weight"] = {"Hkv*Dh", "D"};
      m[b + "k.bias"] = {"Hkv*Dh"};
      m[b + "v.weight"] = {"Hkv*Dh", "D"};
      m[b + "v.bias"] = {"Hkv*Dh"};
      m[b + "o.weight"] = {"D", "D"};
      m[b + "o.bias"] = {"D"};
    }
    for (const char* n : {"norm1", "norm2", "norm3"}) {
      m[std::string(n) + ".weight"] = {"D"};
      m[std::string(n) + ".bias"] = {"D"};
    }
    for (const auto& [n, d] : param_table())
      if (n.starts_with("ffn.")) m[n] = d;
    return m;
  }();
  return t;
}

// An encoder_decoder's decoder layer's activations, by name without "decoder.layers.{i}.": the
// target stream is St long, the memory S.
const std::map<std::string, Dims>& decoder_act_table() {
  static const std::map<std::string, Dims> t = [] {
    std::map<std::string, Dims> m;
    for (const auto& [a, kv] : {std::pair{"self_attn", "St"}, std::pair{"cross_attn", "S"}}) {
      const std::string b = std::string(a) + ".";
      m[b + "q"] = {"B", "H", "St", "Dh"};
      m[b + "k"] = {"B", "Hkv", kv, "Dh"};
      m[b + "v"] = {"B", "Hkv", kv, "Dh"};
      m[b + "scores"] = {"B", "H", "St", kv};
      m[b + "probs"] = {"B", "H", "St", kv};
      m[b + "context"] = {"B", "St", "D"};
      m[b + "out"] = {"B", "St", "D"};
    }
    for (const char* n :
         {"norm1", "norm2", "norm3", "residual1", "residual2", "residual3", "ffn_out", "output"})
      m[n] = {"B", "St", "D"};
    for (const char* n : {"ffn_gate", "ffn_pre", "ffn_hidden"}) m[n] = {"B", "St", "F"};
    return m;
  }();
  return t;
}

// A decoder layer's name without its "decoder.layers.{i}." prefix, or "" for any other name.
std::string in_decoder_layer(const std::string& name) {
  constexpr std::string_view head = "decoder.layers.";
  if (!name.starts_with(head)) return "";
  const auto dot = name.find('.', head.size());
  return dot == std::string::npos ? "" : name.substr(dot + 1);
}

// The symbolic shape of every activation, by its name within its layer (or at the top).
const std::map<std::string, Dims>& act_table() {
  static const std::map<std::string, Dims> t = {
      {"embedding", {"B", "S", "D"}},
      {"positional", {"S", "D"}},
      {"token_type", {"B", "S", "D"}},
      {"embedding_norm", {"B", "S", "D"}},
      {"input", {"B", "S", "D"}},
      {"norm1", {"B", "S", "D"}},
      {"q_a", {"B", "S", "Rq"}},
      {"q_a_norm", {"B", "S", "Rq"}},
      {"q", {"B", "H", "S", "Dh"}},
      {"kv_a", {"B", "S", "Rkv+Dr"}},
      {"kv_norm", {"B", "S", "Rkv"}},
      {"k", {"B", "Hkv", "S", "Dh"}},
      {"v", {"B", "Hkv", "S", "Dv"}},
      {"q_norm", {"B", "H", "S", "Dh"}},
      {"k_norm", {"B", "Hkv", "S", "Dh"}},
      {"q_rot", {"B", "H", "S", "Dh"}},
      {"k_rot", {"B", "Hkv", "S", "Dh"}},
      {"scores", {"B", "H", "S", "S"}},
      {"probs", {"B", "H", "S", "S"}},
      {"context", {"B", "S", "H*Dv"}},
      {"attn_out", {"B", "S", "D"}},
      {"residual1", {"B", "S", "D"}},
      {"norm2", {"B", "S", "D"}},
      {"ffn_gate", {"B", "S", "F"}},
      {"ffn_pre", {"B", "S", "F"}},
      {"ffn_hidden", {"B", "S", "F"}},
      {"moe.logits", {"B", "S", "E"}},
      {"moe.topk_ids", {"B", "S", "k"}},
      {"moe.topk_weights", {"B", "S", "k"}},
      {"moe.expert_offsets", {"E+1"}},
      {"moe.source_rows", {"B*S*k"}},
      {"moe.expert_in", {"B*S*k", "D"}},
      {"moe.expert_hidden", {"B*S*k", "Fe"}},
      {"moe.expert_out", {"B*S*k", "D"}},
      {"moe.shared_out", {"B", "S", "D"}},
      {"ffn_out", {"B", "S", "D"}},
      {"residual2", {"B", "S", "D"}},
      {"output", {"B", "S", "D"}},
      {"final_norm", {"B", "S", "D"}},
      {"pooled", {"B", "D"}},
      {"pooler", {"B", "D"}},
      {"logits", {"B", "C"}},
      {"lm_logits", {"B", "St", "Vt"}},
      {"moe_aux_loss", {}},
      {"moe_z_loss", {}},
      {"loss", {}},
      {"decoder.embedding", {"B", "St", "D"}},
      {"decoder.positional", {"St", "D"}},
      {"decoder.input", {"B", "St", "D"}},
      {"decoder.final_norm", {"B", "St", "D"}},
  };
  return t;
}

// The dropout sites of a layer and the shapes of their masks.
const std::vector<std::pair<std::string, Dims>>& layer_mask_table() {
  static const std::vector<std::pair<std::string, Dims>> t = {
      {"attn", {"B", "H", "S", "S"}},
      {"residual1", {"B", "S", "D"}},
      {"ffn", {"B", "S", "F"}},
      {"residual2", {"B", "S", "D"}},
  };
  return t;
}

// The order in which a layer's forward pass uses its parameter groups; backward produces their
// gradients in the reverse order.
const std::vector<std::string>& layer_use_order(bool norm_first) {
  // an MoE layer's FFN: the router's gate, the routed experts, the shared experts and their gate
  // (the selection bias gets no gradient and has no place)
  const auto with_ffn = [](std::vector<std::string> v, std::size_t at) {
    const std::vector<std::string> ffn = {"ffn.gate",
                                          "ffn.fc1",
                                          "ffn.fc2",
                                          "moe.gate",
                                          "moe.experts.w_gate",
                                          "moe.experts.b_gate",
                                          "moe.experts.w_up",
                                          "moe.experts.b_up",
                                          "moe.experts.w_down",
                                          "moe.experts.b_down",
                                          "moe.shared.gate",
                                          "moe.shared.fc1",
                                          "moe.shared.fc2",
                                          "moe.shared_gate"};
    v.insert(v.begin() + static_cast<std::ptrdiff_t>(at), ffn.begin(), ffn.end());
    return v;
  };
  // the attention's groups: MLA's q path, q, MLA's k/v path, then k, v and the rest
  const std::vector<std::string> attn = {"attn.q_a",  "attn.q_a_norm", "attn.q_b",    "attn.q",
                                         "attn.kv_a", "attn.kv_norm",  "attn.kv_b",   "attn.k",
                                         "attn.v",    "attn.q_norm",   "attn.k_norm", "attn.sinks",
                                         "attn.o"};
  const auto joined = [&](std::vector<std::string> front, std::vector<std::string> back) {
    front.insert(front.end(), attn.begin(), attn.end());
    front.insert(front.end(), back.begin(), back.end());
    return front;
  };
  static const std::vector<std::string> post = with_ffn(joined({}, {"norm1", "norm2"}), 14);
  static const std::vector<std::string> pre = with_ffn(joined({"norm1"}, {"norm2"}), 15);
  return norm_first ? pre : post;
}

// "attn.q" for "attn.q.weight" and "attn.q.bias"; a parameter without either suffix is its own
// group ("attn.sinks").
std::string group_of(const std::string& layer_param) {
  for (const char* suffix : {".weight", ".bias"}) {
    if (layer_param.ends_with(suffix))
      return layer_param.substr(0, layer_param.size() - std::string(suffix).size());
  }
  return layer_param;
}

// "act.generate.{t}.logits" for a step number t (digits, no leading zero).
bool is_generation_logits(const std::string& n) {
  constexpr std::string_view head = "act.generate.", tail = ".logits";
  if (!n.starts_with(head) || !n.ends_with(tail) || n.size() <= head.size() + tail.size())
    return false;
  const std::string t = n.substr(head.size(), n.size() - head.size() - tail.size());
  return std::all_of(t.begin(), t.end(), [](char c) { return c >= '0' && c <= '9'; }) &&
         (t == "0" || t[0] != '0');
}

Dims lookup(const std::map<std::string, Dims>& table, const std::string& key,
            const std::string& what, const std::string& name) {
  const auto it = table.find(key);
  if (it == table.end()) throw std::invalid_argument(name + " is not " + what + " of the contract");
  return it->second;
}

TensorSpec spec(std::string name, Role role, DTypeRule dtype, Dims dims, const ModelConfig& cfg,
                Sizes s) {
  TensorSpec t{std::move(name), role, dtype, std::move(dims), {}};
  t.shape = shape(t.dims, cfg, s);
  return t;
}

// The model's own structure on empty tensors: what Params::visit and Activations::visit name
// for cfg, without allocating anything.
Params<float> empty_params(const ModelConfig& cfg) {
  Params<float> p;
  p.config = cfg;
  p.layers.resize(static_cast<std::size_t>(std::max<index_t>(cfg.num_layers, 0)));
  for (std::size_t i = 0; i < p.layers.size(); ++i)
    p.layers[i].configure(cfg, static_cast<index_t>(i));
  // A decoder layer's visit lists the tensors it holds: zeros of cfg's (small) shapes.
  if (cfg.encoder_decoder()) {
    p.decoder_layers.assign(static_cast<std::size_t>(std::max<index_t>(cfg.dec_layers(), 0)),
                            DecoderLayerParams<float>::markers(cfg, true));
  }
  return p;
}

}  // namespace

const char* to_string(Role r) {
  switch (r) {
    case Role::input:
      return "input";
    case Role::param:
      return "param";
    case Role::mask:
      return "mask";
    case Role::act:
      return "act";
    case Role::grad:
      return "grad";
    case Role::ref64:
      return "ref64";
    case Role::packed:
      return "packed";
  }
  return "?";
}

const char* to_string(DTypeRule d) {
  switch (d) {
    case DTypeRule::i64:
      return "I64";
    case DTypeRule::u8:
      return "U8";
    case DTypeRule::real:
      return "Real";
    case DTypeRule::f64:
      return "F64";
    case DTypeRule::i32:
      return "I32";
    case DTypeRule::i8:
      return "I8";
    case DTypeRule::f16:
      return "F16";
    case DTypeRule::f32:
      return "F32";
    case DTypeRule::f8_e4m3:
      return "F8_E4M3";
  }
  return "?";
}

std::string symbolic(const Dims& dims) {
  std::string s = "[";
  for (std::size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + dims[i];
  return s + "]";
}

std::string TensorSpec::symbolic() const {
  return contract::symbolic(dims);
}

index_t dim(const std::string& sym, const ModelConfig& cfg, Sizes s) {
  if (sym == "B") return s.batch;
  if (sym == "S") return s.seq_len;
  if (sym == "D") return cfg.d_model;
  if (sym == "H") return cfg.attention.num_heads;
  if (sym == "Hkv") return cfg.kv_heads();
  if (sym == "Dh") return cfg.d_head();
  if (sym == "Hkv*Dh") return cfg.kv_heads() * cfg.d_head();
  if (sym == "H*Dh") return cfg.attn_width();
  if (sym == "Dv") return cfg.v_head();
  if (sym == "H*Dv") return cfg.context_width();
  if (sym == "Rq") return cfg.attention.q_lora_rank.value_or(0);
  if (sym == "Rkv") return cfg.attention.kv_lora_rank.value_or(0);
  if (sym == "Rkv+Dr")
    return cfg.attention.kv_lora_rank.value_or(0) + cfg.attention.qk_rope_head_dim;
  if (sym == "H*(Dn+Dv)")
    return cfg.attention.num_heads * (cfg.attention.qk_nope_head_dim + cfg.attention.v_head_dim);
  if (sym == "F") return cfg.ffn.d_ff;
  if (sym == "V") return cfg.embeddings.vocab_size;
  if (sym == "C") return cfg.head.num_classes;
  if (sym == "max_len") return cfg.embeddings.max_len;
  if (sym == "T") return s.steps;
  if (sym == "St") return cfg.encoder_decoder() ? s.tgt_len : s.seq_len;
  if (sym == "Vt") return cfg.target_vocab();
  if (sym == "Tv") return cfg.embeddings.type_vocab_size.value_or(0);
  if (sym == "Ch") return cfg.embeddings.channels;
  if (sym == "Img") return cfg.embeddings.image_size;
  if (sym == "P") return cfg.embeddings.patch_size;
  if (sym == "E") return cfg.ffn.moe.num_experts;
  if (sym == "k") return cfg.ffn.moe.num_experts_per_tok;
  if (sym == "Fe") return cfg.ffn.moe.moe_d_ff;
  if (sym == "Fs") return cfg.ffn.moe.shared_d_ff;
  if (sym == "E+1") return cfg.ffn.moe.num_experts + 1;
  if (sym == "B*S*k") return s.batch * s.seq_len * cfg.ffn.moe.num_experts_per_tok;
  if (sym == "1") return 1;
  throw std::invalid_argument("unknown symbolic dimension \"" + sym + "\"");
}

std::vector<index_t> shape(const Dims& dims, const ModelConfig& cfg, Sizes s) {
  std::vector<index_t> out;
  out.reserve(dims.size());
  for (const auto& d : dims) out.push_back(dim(d, cfg, s));
  return out;
}

Dims param_dims(const std::string& name) {
  if (const auto rest = in_decoder_layer(name); !rest.empty())
    return lookup(decoder_param_table(), rest, "a parameter", name);
  return lookup(param_table(), without_layer(name), "a parameter", name);
}

Dims act_dims(const std::string& name) {
  if (const auto rest = in_decoder_layer(name); !rest.empty())
    return lookup(decoder_act_table(), rest, "an activation", name);
  return lookup(act_table(), without_layer(name), "an activation", name);
}

Dims mask_dims(const std::string& site) {
  if (site == "dropout.input") return {"B", "S", "D"};
  if (site.starts_with("dropout.layers.")) {
    const std::string rest = without_layer(site.substr(8));
    for (const auto& [n, d] : layer_mask_table())
      if (rest == n) return d;
  }
  throw std::invalid_argument(site + " is not a dropout site of the contract");
}

Dims dims_of(const std::string& golden_name) {
  std::string n = golden_name;
  if (n.starts_with("ref64.")) n = n.substr(6);
  if (n == "input.tokens" || n == "input.token_types") return {"B", "S"};
  if (n == "input.lengths" || n == "input.labels") return {"B"};
  if (n.starts_with("input.layers.") && n.ends_with(".moe.topk_ids")) return {"B", "S", "k"};
  if (n == "input.pixels") return {"B", "Ch", "Img", "Img"};
  if (n == "input.generate.tokens") return {"T", "B"};
  if (is_generation_logits(n)) return {"B", "Vt"};
  if (n == "input.src_tokens") return {"B", "S"};
  if (n == "input.tgt_tokens") return {"B", "St"};
  if (n == "input.src_lengths" || n == "input.tgt_lengths") return {"B"};
  if (n.starts_with("dropout.")) return mask_dims(n);
  if (n.starts_with("grad.act.")) return act_dims(n.substr(9));
  if (n.starts_with("act.")) return act_dims(n.substr(4));
  if (n.starts_with("grad.")) return param_dims(n.substr(5));
  if (n.starts_with("param.")) return param_dims(n.substr(6));
  throw std::invalid_argument(golden_name + " is not a tensor name of the contract");
}

std::vector<TensorSpec> params(const ModelConfig& cfg) {
  std::vector<TensorSpec> out;
  empty_params(cfg).visit([&](const std::string& n, const Tensor<float>&) {
    out.push_back(spec(n, Role::param, DTypeRule::real, param_dims(n), cfg, {}));
  });
  return out;
}

std::vector<TensorSpec> activations(const ModelConfig& cfg, Sizes s, bool in_golden) {
  Activations<float> a;
  a.configure(cfg);
  a.layers.resize(static_cast<std::size_t>(std::max<index_t>(cfg.num_layers, 0)));
  if (cfg.encoder_decoder())
    a.decoder_layers.resize(static_cast<std::size_t>(std::max<index_t>(cfg.dec_layers(), 0)));
  std::vector<TensorSpec> out;
  a.visit([&](const std::string& n, const Tensor<float>&) {
    // a decoder layer's third residual is as an encoder layer's second: the output, or the
    // last norm's input
    const bool dec = !in_decoder_layer(n).empty();
    if (in_golden && (n.ends_with(".ffn_gate") || n.ends_with(".ffn_pre") ||
                      n.ends_with(dec ? ".residual3" : ".residual2")))
      return;
    out.push_back(spec(n, Role::act, DTypeRule::real, act_dims(n), cfg, s));
    // an MoE layer's routing after its logits, and its grouped layout after its weights
    const auto ints = [&](std::initializer_list<const char*> names) {
      const std::string layer = n.substr(0, n.rfind("moe."));
      for (const char* m : names) {
        const std::string name = layer + m;
        out.push_back(spec(name, Role::act, DTypeRule::i32, act_dims(name), cfg, s));
      }
    };
    if (n.ends_with(".moe.logits")) ints({"moe.topk_ids"});
    if (n.ends_with(".moe.topk_weights")) ints({"moe.expert_offsets", "moe.source_rows"});
  });
  return out;
}

std::vector<TensorSpec> masks(const ModelConfig& cfg, Sizes s) {
  std::vector<TensorSpec> out;
  out.push_back(
      spec("dropout.input", Role::mask, DTypeRule::u8, mask_dims("dropout.input"), cfg, s));
  for (index_t i = 0; i < cfg.num_layers; ++i) {
    for (const auto& [n, d] : layer_mask_table())
      out.push_back(spec("dropout.layers." + std::to_string(i) + "." + n, Role::mask, DTypeRule::u8,
                         d, cfg, s));
  }
  return out;
}

std::vector<TensorSpec> gradients(const ModelConfig& cfg, Sizes s) {
  // The parameters grouped by where forward uses them, in that order: the embeddings, each
  // layer's groups in its use order, the final norm, the head; the activation gradients of the
  // contract sit between the groups, where backward completes them.
  std::vector<std::string> top_front, top_patch, top_norm, top_final, top_pooler, top_head,
      dec_front, dec_final;
  std::vector<std::vector<std::string>> layers(static_cast<std::size_t>(cfg.num_layers));
  // an encoder_decoder's decoder layers: their parameters in use order (DecoderLayerParams::visit)
  std::vector<std::vector<std::string>> dec_layers(
      static_cast<std::size_t>(cfg.encoder_decoder() ? cfg.dec_layers() : 0));
  std::set<std::string> no_grad;  // weight-only formats have no weight gradient
  for (const auto& w : quantized(cfg)) no_grad.insert(w.name);
  for (const auto& p : params(cfg)) {
    if (no_grad.contains(p.name)) continue;
    if (p.name.starts_with("decoder.layers.")) {
      const auto at = std::string("decoder.layers.").size();
      dec_layers[std::stoul(p.name.substr(at, p.name.find('.', at) - at))].push_back(p.name);
    } else if (p.name.starts_with("decoder.final_norm.")) {
      dec_final.push_back(p.name);
    } else if (p.name.starts_with("decoder.")) {
      dec_front.push_back(p.name);
    } else if (p.name.starts_with("layers.")) {
      const auto dot = p.name.find('.', 7);
      layers[std::stoul(p.name.substr(7, dot - 7))].push_back(p.name);
    } else if (p.name.starts_with("final_norm.")) {
      top_final.push_back(p.name);
    } else if (p.name.starts_with("embedding_norm.")) {
      top_norm.push_back(p.name);
    } else if (p.name.starts_with("patch_embedding.")) {
      top_patch.push_back(p.name);
    } else if (p.name.starts_with("pooler.")) {
      top_pooler.push_back(p.name);
    } else if (p.name.starts_with("head.") || p.name.starts_with("lm_head.")) {
      top_head.push_back(p.name);
    } else {
      top_front.push_back(p.name);
    }
  }
  const auto param = [](const std::string& n) { return "grad." + n; };
  const auto act = [](const std::string& n) { return "grad.act." + n; };
  std::vector<std::vector<std::string>> groups;  // forward order, produced in reverse
  const auto add_group = [&](std::vector<std::string> g) { groups.push_back(std::move(g)); };
  const auto params_of = [&](const std::vector<std::string>& names) {
    std::vector<std::string> g;
    g.reserve(names.size());
    for (const auto& n : names) g.push_back(param(n));
    return g;
  };
  if (!top_patch.empty()) add_group(params_of(top_patch));
  for (const auto& n : top_front) add_group({param(n)});
  if (!top_norm.empty()) add_group(params_of(top_norm));
  add_group({act("input")});
  const auto& order = layer_use_order(cfg.norms.norm_first);
  for (std::size_t i = 0; i < layers.size(); ++i) {
    const std::string prefix = "layers." + std::to_string(i) + ".";
    std::vector<std::vector<std::string>> by_group(order.size());
    for (const auto& n : layers[i]) {
      // the selection bias is for choosing only: no gradient reaches it
      if (n.ends_with(".e_score_correction_bias")) continue;
      const auto it = std::find(order.begin(), order.end(), group_of(n.substr(prefix.size())));
      if (it == order.end())
        throw std::logic_error("parameter " + n + " has no place in the layer's use order");
      by_group[static_cast<std::size_t>(it - order.begin())].push_back(param(n));
    }
    for (auto& g : by_group)
      if (!g.empty()) add_group(std::move(g));
    add_group({act(prefix + "output")});
  }
  if (!top_final.empty()) add_group(params_of(top_final));
  if (cfg.encoder_decoder()) {
    // the decoder: its embeddings, each layer's parameters by block (q, k, v, o, each norm, each
    // FFN projection) in use order with its output's gradient after them, its final norm
    for (const auto& n : dec_front) add_group({param(n)});
    add_group({act("decoder.input")});
    for (std::size_t i = 0; i < dec_layers.size(); ++i) {
      std::vector<std::string> g;
      std::string group;
      for (const auto& n : dec_layers[i]) {
        const std::string here = group_of(in_decoder_layer(n));
        if (here != group && !g.empty()) add_group(std::move(g)), g.clear();
        group = here;
        g.push_back(param(n));
      }
      if (!g.empty()) add_group(std::move(g));
      add_group({act("decoder.layers." + std::to_string(i) + ".output")});
    }
    if (!dec_final.empty()) add_group(params_of(dec_final));
  }
  if (cfg.lm()) {
    // a tied head's weight gradient is in grad.embedding.weight, the first group
    if (!top_head.empty()) add_group(params_of(top_head));
    add_group({act("lm_logits")});
  } else {
    add_group({act("pooled")});
    if (!top_pooler.empty()) {
      add_group(params_of(top_pooler));
      add_group({act("pooler")});
    }
    add_group(params_of(top_head));
    add_group({act("logits")});
  }
  std::vector<TensorSpec> out;
  for (auto g = groups.rbegin(); g != groups.rend(); ++g) {
    for (const auto& n : *g)
      out.push_back(spec(n, Role::grad, DTypeRule::real, dims_of(n), cfg, s));
  }
  return out;
}

bool noise_only(const std::string& golden_name, const ModelConfig& cfg) {
  if (cfg.embeddings.positional == Positional::rope || cfg.attention.attn_sinks ||
      cfg.attention.attn_logit_softcap)
    return false;
  std::string n = golden_name;
  if (n.starts_with("ref64.")) n = n.substr(6);
  // an encoder_decoder's decoder layers: both attentions' key biases, for the same reason
  if (n.starts_with("grad.decoder.layers.")) {
    const auto rest = in_decoder_layer(n.substr(5));
    return rest == "self_attn.k.bias" || rest == "cross_attn.k.bias";
  }
  return n.starts_with("grad.layers.") && without_layer(n.substr(5)) == "attn.k.bias";
}

std::vector<TensorSpec> generation(const ModelConfig& cfg, Sizes s) {
  std::vector<TensorSpec> out;
  if (s.steps <= 0) return out;
  out.push_back(spec("input.generate.tokens", Role::input, DTypeRule::i64, {"T", "B"}, cfg, s));
  for (index_t t = 0; t < s.steps; ++t)
    out.push_back(spec("act.generate." + std::to_string(t) + ".logits", Role::act, DTypeRule::real,
                       {"B", "Vt"}, cfg, s));
  return out;
}

std::vector<TensorSpec> model_case(const ModelConfig& cfg, Sizes s, bool float32) {
  std::vector<TensorSpec> out;
  if (cfg.encoder_decoder()) {
    for (const char* n :
         {"input.src_tokens", "input.src_lengths", "input.tgt_tokens", "input.tgt_lengths"})
      out.push_back(spec(n, Role::input, DTypeRule::i64, dims_of(n), cfg, s));
  } else if (cfg.patches_input()) {
    // the images, in the case's float type; every length is S
    out.push_back(
        spec("input.pixels", Role::input, DTypeRule::real, dims_of("input.pixels"), cfg, s));
    for (const char* n : {"input.lengths", "input.labels"})
      out.push_back(spec(n, Role::input, DTypeRule::i64, dims_of(n), cfg, s));
  } else {
    for (const char* n : {"input.tokens", "input.lengths", "input.labels", "input.token_types"}) {
      if (cfg.decoder() && std::string_view(n) == "input.labels") continue;  // the next tokens
      if (!cfg.embeddings.type_vocab_size && std::string_view(n) == "input.token_types") continue;
      out.push_back(spec(n, Role::input, DTypeRule::i64, dims_of(n), cfg, s));
    }
  }
  const auto gen = generation(cfg, s);
  for (const auto& t : gen)
    if (t.role == Role::input) out.push_back(t);
  if (s.routing_given) {
    for (index_t i = 0; i < cfg.num_layers; ++i) {
      if (!cfg.moe_layer(i)) continue;
      out.push_back(spec("input.layers." + std::to_string(i) + ".moe.topk_ids", Role::input,
                         DTypeRule::i64, {"B", "S", "k"}, cfg, s));
    }
  }
  for (auto t : params(cfg)) {
    t.name = "param." + t.name;
    out.push_back(std::move(t));
  }
  for (auto& t : packed(cfg)) out.push_back(std::move(t));
  if (cfg.dropout > 0) {
    for (auto& t : masks(cfg, s)) out.push_back(std::move(t));
  }
  std::vector<TensorSpec> computed;
  for (auto t : activations(cfg, s)) {
    t.name = "act." + t.name;
    computed.push_back(std::move(t));
  }
  for (const auto& t : gen)
    if (t.role == Role::act) computed.push_back(t);
  for (auto& t : gradients(cfg, s)) computed.push_back(std::move(t));
  out.insert(out.end(), computed.begin(), computed.end());
  if (float32) {
    for (auto t : computed) {
      if (t.dtype == DTypeRule::i32) continue;  // the float64 twin replays the routing
      t.name = "ref64." + t.name;
      t.role = Role::ref64;
      t.dtype = DTypeRule::f64;
      out.push_back(std::move(t));
    }
  }
  return out;
}

}  // namespace teo::contract
