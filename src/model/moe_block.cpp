// An MoE layer's FFN in the model (model/moe_block.hpp): the routed experts through
// teo::moe_forward and moe_backward, the shared experts beside them, and the router's loss terms
// over every MoE layer at once.
#include "model/moe_block.hpp"

#include <algorithm>
#include <string>

#include "teo/layers/moe.hpp"

namespace teo::detail {

namespace {

std::size_t at(index_t i) {
  return static_cast<std::size_t>(i);
}

template <class Real>
MoeWeights<Real> weights_of(const LayerParams<Real>& P) {
  return {P.router_weight.data(),
          data_or_null(P.router_bias),
          data_or_null(P.router_correction),
          P.experts_w_gate.data(),
          P.experts_w_up.data(),
          P.experts_w_down.data(),
          data_or_null(P.experts_b_gate),
          data_or_null(P.experts_b_up),
          data_or_null(P.experts_b_down)};
}

template <class Real>
MoeGrads<Real> grads_of(LayerParams<Real>& G) {
  return {G.router_weight.data(),       data_or_null(G.router_bias),
          G.experts_w_gate.data(),      G.experts_w_up.data(),
          G.experts_w_down.data(),      data_or_null(G.experts_b_gate),
          data_or_null(G.experts_b_up), data_or_null(G.experts_b_down)};
}

template <class Real>
void put(Tensor<Real>& t, const std::vector<Real>& v) {
  std::copy(v.begin(), v.end(), t.data());
}

template <class Real>
SharedExpertWeights<Real> shared_of(const LayerParams<Real>& P) {
  return {P.shared_gate_weight.data(), P.shared_fc1_weight.data(), P.shared_fc2_weight.data(),
          data_or_null(P.shared_expert_gate)};
}

}  // namespace

template <class Real>
void moe_block_forward(const ModelConfig& cfg, const LayerParams<Real>& P, LayerActs<Real>& L,
                       const Real* ffn_in, index_t tokens, const std::int32_t* replay,
                       std::string_view name, const Emulation<Real>& store) {
  const MoeSpec spec = moe_spec(cfg.ffn.moe, cfg.d_model);
  const index_t D = cfg.d_model;
  // each stage rounded where it is complete, named as the layer's moe.<stage>
  const MoeStore<Real> rounded = [&](const char* stage, Real* data, index_t n) {
    store(data, n, name, (std::string("moe.") + stage).c_str());
  };
  moe_forward(spec, weights_of(P), ffn_in, tokens, replay, L.moe, rounded);
  put(L.moe_logits, L.moe.logits);
  put(L.moe_topk_weights, L.moe.routing.weights);
  put(L.moe_expert_in, L.moe.expert_in);
  put(L.moe_expert_hidden, L.moe.hidden);
  put(L.moe_expert_out, L.moe.expert_out);
  // ffn_out = y + shared_out
  put(L.ffn_out, L.moe.y);
  if (P.has_shared) {
    shared_experts_forward(shared_of(P), ffn_in, tokens, D, cfg.ffn.moe.shared_d_ff, L.shared,
                           rounded);
    put(L.moe_shared_out, L.shared.out);
    for (index_t i = 0; i < tokens * D; ++i) L.ffn_out[i] += L.moe_shared_out[i];
  }
  store(L.ffn_out, name, "ffn_out");
}

template <class Real>
void moe_block_backward(const ModelConfig& cfg, const LayerParams<Real>& P,
                        const LayerActs<Real>& L, LayerParams<Real>& G, LayerActs<Real>& dL,
                        const Real* ffn_in, Real* dffn_in, GradWrite write, index_t tokens,
                        const Real* dlogits_extra, std::string_view name,
                        const Emulation<Real>& store) {
  const MoeSpec spec = moe_spec(cfg.ffn.moe, cfg.d_model);
  const index_t D = cfg.d_model;
  // Each stage rounded where it is complete, and kept as dL's gradient of its named activation.
  // The per-expert stages arrive expert by expert, in row order: a cursor places each.
  index_t hidden_at = 0, in_at = 0;
  const MoeStore<Real> kept = [&](const char* stage, Real* data, index_t n) {
    const std::string_view s(stage);
    if (s != "grad.topk_weights") store(data, n, name, (std::string("moe.") + stage).c_str());
    Real* to = nullptr;
    if (s == "grad.logits") to = dL.moe_logits.data();
    if (s == "grad.topk_weights") to = dL.moe_topk_weights.data();
    if (s == "grad.expert_out") to = dL.moe_expert_out.data();
    if (s == "grad.expert_hidden")
      to = dL.moe_expert_hidden.data() + std::exchange(hidden_at, hidden_at + n);
    if (s == "grad.expert_in") to = dL.moe_expert_in.data() + std::exchange(in_at, in_at + n);
    if (to) std::copy(data, data + n, to);
  };
  if (P.has_shared) std::copy(dL.ffn_out.begin(), dL.ffn_out.end(), dL.moe_shared_out.data());
  // the routed experts first, then the shared experts, into dffn_in
  std::vector<Real> dx(at(tokens * D));
  MoeGrads<Real> g = grads_of(G);
  moe_backward(spec, weights_of(P), ffn_in, tokens, L.moe, dL.ffn_out.data(), Real(0), Real(0),
               dx.data(), g, kept, dlogits_extra);
  if (write == GradWrite::overwrite) {
    std::copy(dx.begin(), dx.end(), dffn_in);
  } else {
    for (index_t i = 0; i < tokens * D; ++i) dffn_in[i] += dx[at(i)];
  }
  if (P.has_shared) {
    SharedExpertGrads<Real> sg{G.shared_gate_weight.data(), G.shared_fc1_weight.data(),
                               G.shared_fc2_weight.data(), data_or_null(G.shared_expert_gate)};
    const MoeStore<Real> rounded = [&](const char* stage, Real* data, index_t n) {
      store(data, n, name, (std::string("moe.") + stage).c_str());
    };
    shared_experts_backward(shared_of(P), ffn_in, tokens, D, cfg.ffn.moe.shared_d_ff, L.shared,
                            dL.ffn_out.data(), dffn_in, sg, rounded);
  }
}

namespace {

// The real tokens' rows of every MoE layer, in layer order: (layer, row) pairs.
// What the loss terms read: the real tokens' rows of every MoE layer in layer order ((layer,
// row) pairs, R of them), and their logits (R, E) and ids (R, k) concatenated.
template <class Real>
struct LossRows {
  std::vector<std::pair<std::size_t, index_t>> rows;
  std::vector<Real> logits;
  std::vector<std::int32_t> ids;
  index_t E, k;

  LossRows(const ModelConfig& cfg, const Batch& batch, const Activations<Real>& acts)
      : E(cfg.ffn.moe.num_experts), k(cfg.ffn.moe.num_experts_per_tok) {
    for (std::size_t i = 0; i < acts.layers.size(); ++i) {
      if (!acts.moe_layer(i)) continue;
      for (index_t b = 0; b < batch.batch; ++b)
        for (index_t s = 0; s < batch.lengths[at(b)]; ++s)
          rows.emplace_back(i, b * batch.seq_len + s);
    }
    for (const auto& [i, r] : rows) {
      const auto& m = acts.layers[i].moe;
      logits.insert(logits.end(), m.logits.begin() + r * E, m.logits.begin() + (r + 1) * E);
      ids.insert(ids.end(), m.routing.ids.begin() + r * k, m.routing.ids.begin() + (r + 1) * k);
    }
  }
  index_t count() const { return static_cast<index_t>(rows.size()); }
};

}  // namespace

template <class Real>
Real moe_losses_forward(const ModelConfig& cfg, const Batch& batch, Activations<Real>& acts) {
  if (!acts.moe_aux && !acts.moe_z) return Real(0);
  const LossRows<Real> l(cfg, batch, acts);
  const index_t R = l.count(), E = l.E, k = l.k;
  Real total = 0;
  if (acts.moe_aux) {
    acts.moe_aux_loss[0] = load_balancing_loss(l.logits.data(), l.ids.data(), R, E, k);
    total += static_cast<Real>(cfg.ffn.moe.router_aux_loss_coef) * acts.moe_aux_loss[0];
  }
  if (acts.moe_z) {
    acts.moe_z_loss[0] = router_z_loss(l.logits.data(), R, E);
    total += static_cast<Real>(cfg.ffn.moe.router_z_loss_coef) * acts.moe_z_loss[0];
  }
  return total;
}

template <class Real>
std::vector<std::vector<Real>> moe_losses_backward(const ModelConfig& cfg, const Batch& batch,
                                                   const Activations<Real>& acts, Real dloss) {
  std::vector<std::vector<Real>> out(acts.layers.size());
  if (!acts.moe_aux && !acts.moe_z) return out;
  const LossRows<Real> l(cfg, batch, acts);
  const index_t R = l.count(), E = l.E, k = l.k;
  std::vector<Real> dlogits(at(R * E), Real(0));
  if (acts.moe_aux) {
    load_balancing_loss_backward(l.logits.data(), l.ids.data(), R, E, k,
                                 dloss * static_cast<Real>(cfg.ffn.moe.router_aux_loss_coef),
                                 dlogits.data());
  }
  if (acts.moe_z) {
    router_z_loss_backward(l.logits.data(), R, E,
                           dloss * static_cast<Real>(cfg.ffn.moe.router_z_loss_coef),
                           dlogits.data());
  }
  const index_t N = batch.batch * batch.seq_len;
  for (std::size_t i = 0; i < out.size(); ++i)
    if (acts.moe_layer(i)) out[i].assign(at(N * E), Real(0));
  for (std::size_t j = 0; j < l.rows.size(); ++j) {
    const auto& [i, r] = l.rows[j];
    std::copy(dlogits.begin() + static_cast<std::ptrdiff_t>(j) * E,
              dlogits.begin() + static_cast<std::ptrdiff_t>(j + 1) * E, out[i].begin() + r * E);
  }
  return out;
}

#define TEO_INSTANTIATE(Real)                                                                      \
  template void moe_block_forward<Real>(                                                           \
      const ModelConfig&, const LayerParams<Real>&, LayerActs<Real>&, const Real*, index_t,        \
      const std::int32_t*, std::string_view, const Emulation<Real>&);                              \
  template void moe_block_backward<Real>(const ModelConfig&, const LayerParams<Real>&,             \
                                         const LayerActs<Real>&, LayerParams<Real>&,               \
                                         LayerActs<Real>&, const Real*, Real*, GradWrite, index_t, \
                                         const Real*, std::string_view, const Emulation<Real>&);   \
  template Real moe_losses_forward<Real>(const ModelConfig&, const Batch&, Activations<Real>&);    \
  template std::vector<std::vector<Real>> moe_losses_backward<Real>(                               \
      const ModelConfig&, const Batch&, const Activations<Real>&, Real);
TEO_INSTANTIATE(float)
TEO_INSTANTIATE(double)
#undef TEO_INSTANTIATE

}  // namespace teo::detail
