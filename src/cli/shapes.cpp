#include "cli/commands.hpp"

#include <algorithm>
#include <iomanip>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "teo/model.hpp"

namespace teo::cli {

namespace {

template <class Real>
int run(const EncoderConfig& cfg, const ShapesOptions& o, std::ostream& out) {
  std::vector<std::int64_t> lengths;
  for (index_t b = 0; b < o.batch; ++b) lengths.push_back(std::max<index_t>(0, o.seq_len - 3 * b));
  const Batch batch = Batch::random(cfg, o.batch, o.seq_len, 1, lengths);
  const auto params = Params<Real>::init(cfg, 0);
  Activations<Real> acts;
  forward(params, batch, acts);
  Params<Real> grads;
  Activations<Real> dacts;
  backward(params, batch, acts, grads, dacts);

  out << "teo shapes: " << cfg.to_json().dump() << "\n";
  out << "B=" << o.batch << " S=" << o.seq_len << " D=" << cfg.d_model << " H=" << cfg.num_heads
      << " Dh=" << cfg.d_head() << " F=" << cfg.d_ff << " C=" << cfg.num_classes
      << " V=" << cfg.vocab_size << "  dtype=" << o.dtype << "  parameters=" << params.count()
      << "\n\n";
  auto row = [&](const std::string& name, const std::string& sym, const Shape& s) {
    out << "  " << std::left << std::setw(34) << name << std::setw(16) << sym << s.str() << "\n";
  };
  out << "forward\n";
  row("input.tokens", "(B, S)", Shape({o.batch, o.seq_len}));
  row("input.lengths", "(B)", Shape({o.batch}));
  acts.visit([&](const std::string& n, const Tensor<Real>& t) {
    row("act." + n, golden::symbolic_shape("act." + n), t.shape());
  });
  out << "  loss = " << std::setprecision(17) << acts.loss[0] << "\n\nbackward\n";
  std::vector<std::pair<std::string, Shape>> rev;
  dacts.visit([&](const std::string& n, const Tensor<Real>& t) { rev.emplace_back(n, t.shape()); });
  for (auto it = rev.rbegin(); it != rev.rend(); ++it)
    row("grad.act." + it->first, golden::symbolic_shape("act." + it->first), it->second);
  out << "\nparameter gradients\n";
  grads.visit([&](const std::string& n, const Tensor<Real>& t) {
    row("grad." + n, golden::symbolic_shape(n), t.shape());
  });
  return 0;
}

}  // namespace

int run_shapes(const ShapesOptions& o, std::ostream& out) {
  const EncoderConfig cfg =
      o.config_path.empty() ? EncoderConfig{} : EncoderConfig::from_file(o.config_path);
  cfg.validate();
  ShapesOptions opts = o;
  if (opts.seq_len == 0) opts.seq_len = std::min<index_t>(8, cfg.max_len);
  if (opts.dtype == "float32") return run<float>(cfg, opts, out);
  return run<double>(cfg, opts, out);
}

}  // namespace teo::cli
