#include "cli/commands.hpp"

#include <algorithm>
#include <iomanip>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "teo/contract.hpp"
#include "teo/generate.hpp"
#include "teo/model.hpp"

namespace teo::cli {

namespace {

template <class Real>
int run(const ModelConfig& cfg, const ShapesOptions& o, std::ostream& out) {
  std::vector<std::int64_t> lengths;
  // an image has no padding: every length is full
  for (index_t b = 0; b < o.batch; ++b)
    lengths.push_back(cfg.patches_input() ? o.seq_len : std::max<index_t>(0, o.seq_len - 3 * b));
  // an encoder_decoder's target: tgt_len tokens, its lengths as the source's
  std::vector<std::int64_t> tgt_lengths;
  for (index_t b = 0; b < o.batch; ++b)
    tgt_lengths.push_back(std::max<index_t>(0, o.tgt_len - 2 * b));
  const Batch batch =
      cfg.encoder_decoder()
          ? Batch::random_seq2seq(cfg, o.batch, o.seq_len, o.tgt_len, 1, lengths, tgt_lengths)
          : Batch::random(cfg, o.batch, o.seq_len, 1, lengths);
  const auto params = Params<Real>::init(cfg, 0);
  Activations<Real> acts;
  forward(params, batch, acts);
  Params<Real> grads;
  Activations<Real> dacts;
  backward(params, batch, acts, grads, dacts);

  out << "teo shapes: " << cfg.to_json().dump() << "\n";
  out << "B=" << o.batch << " S=" << o.seq_len << " D=" << cfg.d_model
      << " H=" << cfg.attention.num_heads << " Dh=" << cfg.d_head() << " F=" << cfg.ffn.d_ff
      << " C=" << cfg.head.num_classes
      << (cfg.patches_input() ? " Ch=" + std::to_string(cfg.embeddings.channels) +
                                    " Img=" + std::to_string(cfg.embeddings.image_size) +
                                    " P=" + std::to_string(cfg.embeddings.patch_size)
                              : " V=" + std::to_string(cfg.embeddings.vocab_size))
      << (cfg.moe() ? " E=" + std::to_string(cfg.ffn.moe.num_experts) +
                          " k=" + std::to_string(cfg.ffn.moe.num_experts_per_tok) +
                          " Fe=" + std::to_string(cfg.ffn.moe.moe_d_ff) +
                          " Fs=" + std::to_string(cfg.ffn.moe.shared_d_ff)
                    : std::string())
      << (cfg.attention.mla() ? " Dv=" + std::to_string(cfg.v_head()) +
                                    " Rq=" + std::to_string(cfg.attention.q_lora_rank.value_or(0)) +
                                    " Rkv=" + std::to_string(*cfg.attention.kv_lora_rank) +
                                    " Dn=" + std::to_string(cfg.attention.qk_nope_head_dim) +
                                    " Dr=" + std::to_string(cfg.attention.qk_rope_head_dim)
                              : std::string())
      << "  dtype=" << o.dtype << "  parameters=" << params.count() << "\n\n";
  // Every row is the contract's; the shapes the run produced must be the ones it names.
  const contract::Sizes sizes{o.batch, o.seq_len, o.steps, batch.tgt_len};
  std::map<std::string, Shape> computed;
  acts.visit(
      [&](const std::string& n, const Tensor<Real>& t) { computed["act." + n] = t.shape(); });
  dacts.visit(
      [&](const std::string& n, const Tensor<Real>& t) { computed["grad.act." + n] = t.shape(); });
  grads.visit(
      [&](const std::string& n, const Tensor<Real>& t) { computed["grad." + n] = t.shape(); });
  auto row = [&](const std::string& name, const contract::TensorSpec& t) {
    const Shape s(t.shape);
    if (const auto it = computed.find(name); it != computed.end() && !(it->second == s))
      throw std::logic_error(name + " is " + it->second.str() + ", the contract says " + s.str());
    const std::string dims = t.symbolic();
    out << "  " << std::left << std::setw(34) << name << (name.size() >= 34 ? " " : "")
        << std::setw(16) << dims << (dims.size() >= 16 ? " " : "") << s.str() << "\n";
  };
  out << "forward\n";
  for (const auto& t : contract::model_case(cfg, sizes, false)) {
    if (t.role == contract::Role::input && t.name != "input.generate.tokens") row(t.name, t);
  }
  const auto activations = contract::activations(cfg, sizes, /*in_golden=*/false);
  for (const auto& t : activations) row("act." + t.name, t);
  out << "  loss = " << std::setprecision(17) << acts.loss[0] << "\n\nbackward\n";
  for (auto it = activations.rbegin(); it != activations.rend(); ++it) {
    // an encoder_decoder's backward keeps of each decoder layer only its output's gradient
    if (it->name.starts_with("decoder.layers.") && !it->name.ends_with(".output")) continue;
    if (it->dtype == contract::DTypeRule::i32) continue;  // the routing has no gradient
    row("grad.act." + it->name, *it);
  }
  out << "\nparameter gradients\n";
  for (const auto& t : contract::params(cfg)) {
    // the selection bias chooses only: its gradient is no tensor of the contract
    if (!t.name.ends_with(".e_score_correction_bias")) row("grad." + t.name, t);
  }
  if (cfg.dropout > 0) {
    out << "\ndropout masks (train mode)\n";
    for (const auto& t : contract::masks(cfg, sizes)) row(t.name, t);
  }
  if (o.steps > 0) {
    // greedy steps through the KV cache, prompted by each sequence's real tokens
    const auto gen = generate(params, batch, {.steps = o.steps});
    computed["input.generate.tokens"] = Shape{o.steps, o.batch};
    for (index_t t = 0; t < o.steps; ++t)
      computed["act.generate." + std::to_string(t) + ".logits"] =
          gen.logits[static_cast<std::size_t>(t)].shape();
    out << "\ngeneration (" << o.steps << " steps)\n";
    for (const auto& t : contract::generation(cfg, {o.batch, o.seq_len, o.steps})) row(t.name, t);
  }
  return 0;
}

}  // namespace

int run_shapes(const ShapesOptions& o, std::ostream& out) {
  const ModelConfig cfg =
      o.config_path.empty() ? ModelConfig{} : ModelConfig::from_file(o.config_path);
  cfg.validate();
  ShapesOptions opts = o;
  // images: the sequence is [CLS] and the patches, max_len long
  if (opts.seq_len == 0)
    opts.seq_len =
        cfg.patches_input() ? cfg.embeddings.max_len : std::min<index_t>(8, cfg.embeddings.max_len);
  if (opts.tgt_len != 0 && !cfg.encoder_decoder())
    throw ConfigError("--tgt-len applies only to architecture \"encoder_decoder\"");
  if (cfg.encoder_decoder() && opts.tgt_len == 0) opts.tgt_len = opts.seq_len;
  if (opts.steps > 0 && !cfg.decoder())
    throw ConfigError("--steps needs a decoder (architecture \"decoder\")");
  if (opts.steps > 0 && opts.steps > cfg.embeddings.max_len - opts.seq_len) {
    throw ShapeError("--steps " + std::to_string(opts.steps) + " after a prompt of " +
                     std::to_string(opts.seq_len) + " tokens runs past max_len " +
                     std::to_string(cfg.embeddings.max_len));
  }
  if (opts.dtype == "float32") return run<float>(cfg, opts, out);
  return run<double>(cfg, opts, out);
}

}  // namespace teo::cli
