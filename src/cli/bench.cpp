#include <algorithm>
#include <iomanip>
#include <optional>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli/commands.hpp"
#include "teo/backend.hpp"
#include "teo/bench.hpp"
#include "teo/precision.hpp"

namespace teo::cli {

namespace {

// The preset with the keys of `with` (a JSON object) over its config; ConfigError naming a bad key.
bench::Preset with_keys(bench::Preset p, const std::string& with) {
  if (with.empty()) return p;
  nlohmann::json j = p.config.to_json();
  nlohmann::json over;
  try {
    over = nlohmann::json::parse(with);
  } catch (const nlohmann::json::exception& e) {
    throw ConfigError(std::string("--with is not valid JSON: ") + e.what());
  }
  if (!over.is_object()) throw ConfigError("--with must be a JSON object of config keys");
  j.update(over);
  if (ModelConfig::architecture_of(j) == "decoder") {
    // a decoder is causal and has no classifier: the preset's encoder keys do not carry over
    if (!over.contains("causal")) j["causal"] = true;
    if (!over.contains("pooling")) j.erase("pooling");
    if (!over.contains("num_classes")) j.erase("num_classes");
  }
  try {
    p.config = ModelConfig::from_json(j);
  } catch (const ConfigError& e) {
    throw ConfigError(std::string("--with: ") + e.what());
  }
  return p;
}

bench::Result measure(const bench::Preset& p, const BenchOptions& o) {
  return o.dtype == "float64" ? bench::measure<double>(p, o.repeats, o.warmup)
                              : bench::measure<float>(p, o.repeats, o.warmup);
}

}  // namespace

int run_bench(const BenchOptions& o, std::ostream& out) {
  const bench::Preset plain = bench::preset(o.preset);
  const bench::Preset p = with_keys(plain, o.with);
  const ModelConfig& cfg = p.config;
  // The yardstick first, in the same process: the FMA peak of this ISA, dtype and thread count.
  const bench::Peak peak =
      o.dtype == "float64" ? bench::fma_peak<double>() : bench::fma_peak<float>();
  const bench::Result r = measure(p, o);
  const double fwd = bench::median(r.fwd_ms), fwd_bwd = bench::median(r.fwd_bwd_ms);
  const double gflops_fwd = r.flops / (fwd * 1e6), gflops_fwd_bwd = 3 * r.flops / (fwd_bwd * 1e6);
  const std::optional<double> frac = bench::fraction_of_peak(gflops_fwd_bwd, peak);
  const std::optional<double> frac_fwd = bench::fraction_of_peak(gflops_fwd, peak);
  const CpuInfo& cpu = cpu_info();
  const auto fraction_json = [](const std::optional<double>& f) {
    return f ? nlohmann::json(*f) : nlohmann::json(nullptr);
  };
  if (o.json) {
    out << nlohmann::json{{"preset", o.preset},
                          {"dtype", o.dtype},
                          {"threads", num_threads()},
                          {"backend", to_string(backend())},
                          {"isa", to_string(isa())},
                          {"openblas_core", openblas_core()},
                          {"cpu",
                           {{"vendor", cpu.vendor},
                            {"family", cpu.family},
                            {"model", cpu.model},
                            {"stepping", cpu.stepping},
                            {"brand", cpu.brand}}},
                          {"fwd_ms", fwd},
                          {"fwd_bwd_ms", fwd_bwd},
                          {"gflops_fwd", gflops_fwd},
                          {"gflops_fwd_bwd", gflops_fwd_bwd},
                          {"peak_gflops", peak.gflops},
                          {"peak_median_gflops", peak.median_gflops},
                          {"peak_one_thread_gflops", peak.one_thread_gflops},
                          {"peak_cores", peak.cores},
                          {"peak_pinned", peak.pinned},
                          {"peak_attempts", peak.attempts},
                          {"peak_reliable", peak.reliable},
                          {"fraction_of_peak", fraction_json(frac)},
                          {"fraction_of_peak_fwd", fraction_json(frac_fwd)},
                          {"probe_error", !frac || !frac_fwd},
                          {"repeats", o.repeats}}
               .dump()
        << "\n";
    return 0;
  }
  out << "teo bench: preset " << o.preset << ", " << o.dtype << ", backend " << to_string(backend())
      << ", isa " << to_string(isa()) << ", threads " << num_threads()
      << (backend() == Backend::blas ? ", OpenBLAS kernels " + openblas_core() : "")
      << "\n  B=" << p.batch << " S=" << p.seq_len << " D=" << cfg.d_model
      << " H=" << cfg.attention.num_heads << " F=" << cfg.ffn.d_ff << " layers=" << cfg.num_layers
      << " " << to_string(cfg.ffn.activation) << (cfg.norms.norm_first ? " pre-norm" : " post-norm")
      << ", dropout 0; " << o.repeats << " timed runs after " << o.warmup << " warm-up\n  CPU "
      << cpu.describe() << "\n  FMA peak " << std::fixed << std::setprecision(1) << peak.gflops
      << " GFLOP/s (" << peak.isa << ", " << o.dtype << ", " << peak.threads << " thread(s) on "
      << peak.cores << (peak.pinned ? " pinned" : " unpinned") << " CPU(s): " << peak.chains
      << " chains of " << peak.lanes << "-lane FMAs per thread, the best of " << peak.rounds
      << " rounds; median " << peak.median_gflops << ", slowest " << peak.min_gflops
      << "; one thread alone " << peak.one_thread_gflops
      << (peak.attempts > 1 ? ", after " + std::to_string(peak.attempts) + " attempts" : "")
      << ")\n";
  if (!peak.reliable)
    out << "  UNRELIABLE PEAK: " << peak.threads << " thread(s) reached " << peak.gflops
        << " GFLOP/s, below " << bench::kPeakScaling << " x " << peak.cores << " x one thread's "
        << peak.one_thread_gflops << ", in each of " << peak.attempts
        << " attempts: another process shares these cores; the fractions of peak below are not "
           "to be trusted\n";
  int probe_errors = 0;
  const auto print_fraction = [&](const std::optional<double>& f, int width) {
    if (f) {
      out << std::setw(width) << std::setprecision(2) << *f;
    } else {
      ++probe_errors;
      out << std::setw(width) << "error";
    }
  };
  out << "\n  " << std::left << std::setw(20) << "stage" << std::right << std::setw(12) << "ms/run"
      << std::setw(10) << "share" << std::setw(11) << "GFLOP/s" << std::setw(10) << "of peak\n";
  const auto sf = bench::stage_flops(cfg, p.batch, p.seq_len);
  double total = 0;
  for (const auto& s : r.stages) total += s.seconds;
  for (const auto& s : r.stages) {
    const double ms = 1e3 * s.seconds / o.repeats;
    out << "  " << std::left << std::setw(20) << profile::name(s.stage) << std::right << std::fixed
        << std::setprecision(2) << std::setw(12) << ms << std::setw(9) << std::setprecision(1)
        << 100 * s.seconds / total << "%";
    if (const auto it = sf.find(s.stage); it != sf.end()) {
      const double g = it->second / (ms * 1e6);
      out << std::setw(11) << g;
      print_fraction(bench::fraction_of_peak(g, peak), 9);
      out << "\n";
    } else {
      out << std::setw(11) << "-" << std::setw(9) << "-"
          << "\n";
    }
  }
  if (!o.precision.empty()) {
    // The emulated pass against the plain float32 pass above, timed in the same process.
    const Precision prec = parse_precision(o.precision, "--precision");
    if (o.dtype != "float32" || prec == Precision::fp32 || prec == Precision::fp64) {
      throw ConfigError("--precision takes tf32, bf16, fp16 or fp8, with --dtype float32");
    }
    // fp8 is also timed next to bf16, its storage format: the difference is the quantization.
    std::vector<Precision> runs = {prec};
    if (prec == Precision::fp8) runs.insert(runs.begin(), Precision::bf16);
    for (const Precision q : runs) {
      const bench::Result e = bench::measure<float>(p, o.repeats, o.warmup, q);
      const double efb = bench::median(e.fwd_bwd_ms);
      out << std::fixed << std::setprecision(2) << "\n  " << to_string(q)
          << " emulation: forward+backward median " << efb << " ms against " << fwd_bwd
          << " ms in float32: +" << std::setprecision(1) << 100 * (efb / fwd_bwd - 1)
          << "% for the rounding" << (q == Precision::fp8 ? " and quantization" : "") << "\n";
    }
  }
  if (!o.with.empty()) {
    // The variant's cost as a ratio measured in one process: the plain preset and the variant
    // timed in turn, three rounds each, so that a shared machine's drift falls on both; medians
    // over all rounds.
    std::vector<double> vf = r.fwd_ms, vfb = r.fwd_bwd_ms, pf, pfb;
    for (int round = 0; round < 3; ++round) {
      const bench::Result b = measure(plain, o);
      pf.insert(pf.end(), b.fwd_ms.begin(), b.fwd_ms.end());
      pfb.insert(pfb.end(), b.fwd_bwd_ms.begin(), b.fwd_bwd_ms.end());
      if (round == 2) break;
      const bench::Result v = measure(p, o);
      vf.insert(vf.end(), v.fwd_ms.begin(), v.fwd_ms.end());
      vfb.insert(vfb.end(), v.fwd_bwd_ms.begin(), v.fwd_bwd_ms.end());
    }
    const double bf = bench::median(pf), bfb = bench::median(pfb);
    const double vm = bench::median(vf), vmb = bench::median(vfb);
    out << std::fixed << std::setprecision(2) << "\n  with " << o.with << ": forward " << vm
        << " ms against " << bf << " ms for the plain preset (" << std::showpos
        << std::setprecision(1) << 100 * (vm / bf - 1) << "%), forward+backward " << std::noshowpos
        << std::setprecision(2) << vmb << " ms against " << bfb << " ms (" << std::showpos
        << std::setprecision(1) << 100 * (vmb / bfb - 1) << std::noshowpos
        << "%); medians of 3 alternating rounds\n";
  }
  out << std::fixed << std::setprecision(2) << "\n  forward           median " << fwd
      << " ms  (min " << *std::min_element(r.fwd_ms.begin(), r.fwd_ms.end()) << ")  "
      << std::setprecision(1) << gflops_fwd << " GFLOP/s, ";
  print_fraction(frac_fwd, 0);
  out << " of peak\n"
      << "  forward+backward  median " << std::setprecision(2) << fwd_bwd << " ms  (min "
      << *std::min_element(r.fwd_bwd_ms.begin(), r.fwd_bwd_ms.end()) << ")  "
      << std::setprecision(1) << gflops_fwd_bwd << " GFLOP/s, ";
  print_fraction(frac, 0);
  out << " of peak\n  FLOPs: forward " << std::setprecision(3) << r.flops / 1e9
      << " G (8BSD^2 + 4BS^2D + 4BSDF per layer); forward+backward 3x\n";
  if (probe_errors > 0)
    out << "  PROBE ERROR: " << probe_errors
        << " rate(s) above the measured FMA peak, which no computation can outrun: the probe "
           "measured too little, and those fractions are left out\n";
  return 0;
}

}  // namespace teo::cli
