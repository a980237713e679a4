// ModelConfig's mixture-of-experts keys (include/teo/config.hpp, MoeConfig): JSON, validation
// and sizes. The router's and the experts' own rules are RouterSpec::validate and
// MoeSpec::validate, named here by their keys.
#include "core/config_moe.hpp"

#include "core/json_get.hpp"

#include <cmath>
#include <sstream>

#include <nlohmann/json.hpp>

namespace teo {

namespace detail {

namespace {

// One of `names` (the enum's values in order), by its index.
std::size_t choice_of(const nlohmann::json& v, const std::string& key,
                      std::initializer_list<const char*> names) {
  std::string list;
  std::size_t i = 0;
  for (const char* n : names) {
    if (v.is_string() && v.get<std::string>() == n) return i;
    list += (i ? i + 1 == names.size() ? " or \"" : ", \"" : "\"") + std::string(n) + "\"";
    ++i;
  }
  throw ConfigError(key + " must be " + list + ", got " + v.dump());
}

std::string fmt(double v) {
  std::ostringstream os;
  os.precision(17);
  os << v;
  return os.str();
}

}  // namespace

void validate_router_keys(index_t experts, index_t top_k, index_t groups, index_t topk_groups,
                          GroupScore group_score, double routed_scaling_factor) {
  if (experts < 1)
    throw ConfigError("num_experts must be at least 1, got " + std::to_string(experts));
  if (groups < 1 || experts % groups != 0) {
    throw ConfigError("router_groups must divide num_experts = " + std::to_string(experts) +
                      ", got " + std::to_string(groups));
  }
  if (topk_groups < 1 || topk_groups > groups) {
    throw ConfigError("topk_groups must be in [1, router_groups = " + std::to_string(groups) +
                      "], got " + std::to_string(topk_groups));
  }
  if (groups > 1 && group_score == GroupScore::top2_sum && experts / groups < 2) {
    throw ConfigError("group_score \"top2_sum\" needs two experts per group, got " +
                      std::to_string(experts / groups));
  }
  const index_t eligible = experts / groups * topk_groups;
  if (top_k < 1 || top_k > eligible) {
    throw ConfigError("num_experts_per_tok must be in [1, " + std::to_string(eligible) +
                      "] (the experts of topk_groups groups), got " + std::to_string(top_k));
  }
  if (!(routed_scaling_factor > 0) || !std::isfinite(routed_scaling_factor)) {
    throw ConfigError("routed_scaling_factor must be finite and positive, got " +
                      std::to_string(routed_scaling_factor));
  }
}

void validate_expert_keys(ExpertKind kind, index_t d_model, index_t d_ff, double alpha,
                          double limit) {
  if (d_model < 1 || d_ff < 1) {
    throw ConfigError("a mixture of experts needs d_model and moe_d_ff of at least 1, got " +
                      std::to_string(d_model) + " and " + std::to_string(d_ff));
  }
  if (kind == ExpertKind::clamped_swiglu &&
      (!(alpha > 0) || !std::isfinite(alpha) || !(limit > 0) || !std::isfinite(limit))) {
    throw ConfigError("the clamped SwiGLU's alpha and limit must be finite and positive");
  }
}

const std::vector<std::string>& moe_keys() {
  static const std::vector<std::string> k = {
      "num_experts",          "num_experts_per_tok", "router_scoring",
      "router_order",         "router_groups",       "topk_groups",
      "group_score",          "norm_topk_prob",      "routed_scaling_factor",
      "router_bias",          "selection_bias",      "moe_d_ff",
      "expert_kind",          "swiglu_alpha",        "swiglu_limit",
      "expert_bias",          "weight_at",           "shared_d_ff",
      "shared_expert_gate",   "first_dense_layers",  "moe_every",
      "router_aux_loss_coef", "router_z_loss_coef"};
  return k;
}

bool read_moe_key(MoeConfig& m, const std::string& key, const nlohmann::json& v) {
  if (key == "num_experts") {
    m.num_experts = get_int(v, key);
  } else if (key == "num_experts_per_tok") {
    m.num_experts_per_tok = get_int(v, key);
  } else if (key == "router_scoring") {
    m.router_scoring = static_cast<RouterScoring>(choice_of(v, key, {"softmax", "sigmoid"}));
  } else if (key == "router_order") {
    m.router_order =
        static_cast<RouterOrder>(choice_of(v, key, {"score_then_topk", "topk_then_score"}));
  } else if (key == "router_groups") {
    m.router_groups = get_int(v, key);
  } else if (key == "topk_groups") {
    m.topk_groups = get_int(v, key);
  } else if (key == "group_score") {
    m.group_score = static_cast<GroupScore>(choice_of(v, key, {"top2_sum", "max"}));
  } else if (key == "norm_topk_prob") {
    m.norm_topk_prob = get_bool(v, key);
  } else if (key == "routed_scaling_factor") {
    m.routed_scaling_factor = get_real(v, key);
  } else if (key == "router_bias") {
    m.router_bias = get_bool(v, key);
  } else if (key == "selection_bias") {
    m.selection_bias = get_bool(v, key);
  } else if (key == "moe_d_ff") {
    m.moe_d_ff = get_int(v, key);
  } else if (key == "expert_kind") {
    m.expert_kind = static_cast<ExpertKind>(choice_of(v, key, {"swiglu", "clamped_swiglu"}));
  } else if (key == "swiglu_alpha") {
    m.swiglu_alpha = get_real(v, key);
  } else if (key == "swiglu_limit") {
    m.swiglu_limit = get_real(v, key);
  } else if (key == "expert_bias") {
    m.expert_bias = get_bool(v, key);
  } else if (key == "weight_at") {
    m.weight_at_input = choice_of(v, key, {"output", "input"}) == 1;
  } else if (key == "shared_d_ff") {
    m.shared_d_ff = get_int(v, key);
  } else if (key == "shared_expert_gate") {
    m.shared_expert_gate = get_bool(v, key);
  } else if (key == "first_dense_layers") {
    m.first_dense_layers = get_int(v, key);
  } else if (key == "moe_every") {
    m.moe_every = get_int(v, key);
  } else if (key == "router_aux_loss_coef") {
    m.router_aux_loss_coef = get_real(v, key);
  } else if (key == "router_z_loss_coef") {
    m.router_z_loss_coef = get_real(v, key);
  } else {
    return false;
  }
  return true;
}

void moe_to_json(const ModelConfig& c, nlohmann::json& j) {
  if (!c.moe()) return;
  const MoeConfig& m = c.ffn.moe;
  j["num_experts"] = m.num_experts;
  j["num_experts_per_tok"] = m.num_experts_per_tok;
  j["moe_d_ff"] = m.moe_d_ff;
  j["router_scoring"] = m.router_scoring == RouterScoring::sigmoid ? "sigmoid" : "softmax";
  j["router_order"] =
      m.router_order == RouterOrder::topk_then_score ? "topk_then_score" : "score_then_topk";
  if (m.router_groups > 1) {
    j["router_groups"] = m.router_groups;
    j["topk_groups"] = m.topk_groups;
    j["group_score"] = m.group_score == GroupScore::max ? "max" : "top2_sum";
  }
  j["norm_topk_prob"] = m.norm_topk_prob;
  j["routed_scaling_factor"] = m.routed_scaling_factor;
  j["router_bias"] = m.router_bias;
  j["selection_bias"] = m.selection_bias;
  const bool clamped = m.expert_kind == ExpertKind::clamped_swiglu;
  j["expert_kind"] = clamped ? "clamped_swiglu" : "swiglu";
  if (clamped) {
    j["swiglu_alpha"] = m.swiglu_alpha;
    j["swiglu_limit"] = m.swiglu_limit;
  }
  j["expert_bias"] = m.expert_bias;
  j["weight_at"] = m.weight_at_input ? "input" : "output";
  j["shared_d_ff"] = m.shared_d_ff;
  j["shared_expert_gate"] = m.shared_expert_gate;
  j["first_dense_layers"] = m.first_dense_layers;
  j["moe_every"] = m.moe_every;
  j["router_aux_loss_coef"] = m.router_aux_loss_coef;
  j["router_z_loss_coef"] = m.router_z_loss_coef;
}

void validate_moe(const ModelConfig& c) {
  const MoeConfig& m = c.ffn.moe;
  if (!c.moe()) {
    if (!(m == MoeConfig{}))
      throw ConfigError("the mixture-of-experts keys (num_experts, ...) apply only to ffn \"moe\"");
    return;
  }
  if (c.encoder_decoder()) {
    throw ConfigError(
        "ffn \"moe\" runs in architectures \"encoder\" and \"decoder\"; an encoder_decoder's "
        "decoder layers do not take it yet");
  }
  if (c.dropout > 0) {
    throw ConfigError("ffn \"moe\" has no dropout sites inside its experts yet: dropout must be 0");
  }
  if (m.router_groups == 1 && (m.topk_groups != 1 || m.group_score != GroupScore::top2_sum))
    throw ConfigError("topk_groups and group_score go with router_groups > 1");
  if (m.expert_kind != ExpertKind::clamped_swiglu &&
      (m.swiglu_alpha != MoeConfig{}.swiglu_alpha || m.swiglu_limit != MoeConfig{}.swiglu_limit))
    throw ConfigError("swiglu_alpha and swiglu_limit go with expert_kind \"clamped_swiglu\"");
  if (m.shared_d_ff < 0)
    throw ConfigError("shared_d_ff must be >= 0 (0: no shared experts), got " +
                      std::to_string(m.shared_d_ff));
  if (m.shared_expert_gate && m.shared_d_ff == 0)
    throw ConfigError("shared_expert_gate needs shared experts (shared_d_ff > 0)");
  if (m.first_dense_layers < 0)
    throw ConfigError("first_dense_layers must be >= 0, got " +
                      std::to_string(m.first_dense_layers));
  if (m.moe_every < 1)
    throw ConfigError("moe_every must be >= 1, got " + std::to_string(m.moe_every));
  for (const auto& [key, v] : {std::pair{"router_aux_loss_coef", m.router_aux_loss_coef},
                               std::pair{"router_z_loss_coef", m.router_z_loss_coef}}) {
    if (!(v >= 0) || !std::isfinite(v))
      throw ConfigError(std::string(key) + " must be finite and >= 0, got " + fmt(v));
  }
  validate_router_keys(m.num_experts, m.num_experts_per_tok, m.router_groups, m.topk_groups,
                       m.group_score, m.routed_scaling_factor);
  if (m.moe_d_ff < 1) throw ConfigError("moe_d_ff must be >= 1, got " + std::to_string(m.moe_d_ff));
  validate_expert_keys(m.expert_kind, c.d_model, m.moe_d_ff, m.swiglu_alpha, m.swiglu_limit);
}

index_t moe_param_count(const ModelConfig& c) {
  if (!c.moe()) return 0;
  const MoeConfig& m = c.ffn.moe;
  const index_t D = c.d_model, E = m.num_experts, Fe = m.moe_d_ff, Fs = m.shared_d_ff;
  const index_t expert = checked_mul(checked_mul(E, Fe, "experts"), D, "moe.experts.w_gate");
  const MemoryLimits lim = memory_limits();
  if (expert > lim.max_tensor_elements) {
    throw ShapeError("moe.experts.w_gate would have " + std::to_string(expert) +
                     " elements, more than the limit of " +
                     std::to_string(lim.max_tensor_elements) + " (TEO_MAX_TENSOR_ELEMENTS)");
  }
  index_t layer =
      checked_add(checked_mul(expert, 3, "experts"),
                  checked_mul(E, checked_add(D, 2 * Fe + D + 2, "biases"), "biases"), "moe layer");
  layer = checked_add(
      layer, checked_add(checked_mul(checked_mul(Fs, D, "shared"), 3, "shared"), D, "shared"),
      "moe layer");
  index_t n = 0;
  for (index_t i = 0; i < c.num_layers; ++i)
    if (c.moe_layer(i)) n = checked_add(n, layer, "all moe layers");
  return n;
}

index_t moe_activation_values(const ModelConfig& c, index_t tokens) {
  if (!c.moe()) return 0;
  const MoeConfig& m = c.ffn.moe;
  const index_t k = m.num_experts_per_tok, D = c.d_model, Fe = m.moe_d_ff;
  // the grouped rows (in, three middles and out, kept and named), the logits and scores, the
  // shared experts' four
  const index_t rows = checked_mul(tokens, k, "tokens x num_experts_per_tok");
  const index_t grouped =
      checked_mul(rows, checked_add(checked_mul(D, 3, "rows"), checked_mul(Fe, 4, "rows"), "rows"),
                  "grouped rows");
  const index_t router = checked_mul(tokens, checked_mul(m.num_experts, 3, "router"), "router");
  const index_t shared = checked_mul(tokens, checked_mul(m.shared_d_ff + D, 4, "shared"), "shared");
  return checked_add(checked_add(grouped, router, "moe"), shared, "moe");
}

}  // namespace detail
}  // namespace teo
