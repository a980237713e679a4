// `teo bench` as a process: the JSON line carries every documented key (preset, dtype, threads,
// backend, isa, fwd_ms, fwd_bwd_ms, gflops_fwd_bwd) with the preset's FLOP convention, and the
// table names every timed stage.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>

#include "cli/run_cli.hpp"

namespace {

using teo::test::run_cli;

// The small preset: B 32, S 64, D 256, F 1024, 4 layers; forward = 8BSD^2 + 4BS^2D + 4BSDF per
// layer, forward+backward = 3 x forward.
double small_forward_flops() {
  const double B = 32, S = 64, D = 256, F = 1024, layers = 4;
  return layers * (8 * B * S * D * D + 4 * B * S * S * D + 4 * B * S * D * F);
}

TEST(Cli, BenchJsonHasEveryKeyAndTheFlopConvention) {
  const auto r = run_cli(
      "bench --preset small --dtype float32 --backend simd --threads 2 --repeats 1 --warmup 0 "
      "--json");
  ASSERT_EQ(r.code, 0) << r.out;
  const auto j = nlohmann::json::parse(r.out);
  for (const char* key : {"preset", "dtype", "threads", "backend", "isa", "openblas_core", "fwd_ms",
                          "fwd_bwd_ms", "gflops_fwd_bwd"})
    EXPECT_TRUE(j.contains(key)) << key << " missing from " << r.out;
  EXPECT_EQ(j["preset"], "small");
  EXPECT_EQ(j["dtype"], "float32");
  EXPECT_EQ(j["threads"], 2);
  EXPECT_EQ(j["backend"], "simd");
  const double fwd = j["fwd_ms"], fwd_bwd = j["fwd_bwd_ms"], gflops = j["gflops_fwd_bwd"];
  EXPECT_GT(fwd, 0.0);
  EXPECT_GT(fwd_bwd, fwd);
  EXPECT_NEAR(gflops, 3 * small_forward_flops() / (fwd_bwd * 1e6), 1e-9 * gflops);
  // the FMA peak measured in the same run, and the fractions of it
  const double peak = j["peak_gflops"];
  EXPECT_GT(peak, 0.0);
  // a fraction is the plain ratio when it is at most 1; above 1 it is null and probe_error is set
  for (const char* key : {"fraction_of_peak", "fraction_of_peak_fwd"}) {
    const double rate =
        key == std::string("fraction_of_peak") ? gflops : j["gflops_fwd"].get<double>();
    if (rate <= peak)
      EXPECT_NEAR(j[key].get<double>(), rate / peak, 1e-12) << key;
    else
      EXPECT_TRUE(j[key].is_null() && j["probe_error"].get<bool>()) << key;
  }
  // the peak's terms: one thread's rate, the CPUs, the attempts and whether it held the rule
  const double one = j["peak_one_thread_gflops"];
  const int cores = j["peak_cores"];
  EXPECT_GT(one, 0.0);
  EXPECT_GE(cores, 1);
  EXPECT_TRUE(j["peak_pinned"].get<bool>());
  EXPECT_EQ(j["peak_reliable"].get<bool>(), peak >= 0.8 * cores * one);
  // the CPU beside the ISA
  EXPECT_FALSE(j["cpu"]["vendor"].get<std::string>().empty());
  EXPECT_TRUE(j["cpu"].contains("family") && j["cpu"].contains("model"));
}

TEST(Cli, BenchTableNamesEveryStageAndBothMedians) {
  const auto r = run_cli("bench --preset small --dtype float64 --threads 1 --repeats 1 --warmup 0");
  ASSERT_EQ(r.code, 0) << r.out;
  for (const char* stage :
       {"embedding", "qkv_proj", "attention", "out_proj", "layer_norm", "ffn_fc1", "activation",
        "ffn_fc2", "bwd.ffn_fc1", "bwd.attention", "bwd.qkv_proj", "forward  ", "forward+backward",
        "FMA peak ", "of peak\n", " of peak\n  FLOPs", "\n  CPU ", "one thread alone"})
    EXPECT_NE(r.out.find(stage), std::string::npos) << stage << " missing from\n" << r.out;
}

TEST(Cli, BenchWithVariantKeysTimesThePlainPresetToo) {
  const auto r = run_cli(
      "bench --preset small --dtype float32 --threads 2 --repeats 1 --warmup 0 --with "
      "'{\"num_kv_heads\": 2, \"positional\": \"rope\", \"attn_sinks\": true}'");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("ms for the plain preset"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("forward+backward"), std::string::npos) << r.out;
  const auto bad = run_cli("bench --repeats 1 --warmup 0 --with '{\"sliding_window\": 0}'");
  EXPECT_EQ(bad.code, 2) << bad.out;
  EXPECT_NE(bad.out.find("sliding_window"), std::string::npos) << bad.out;
  const auto junk = run_cli("bench --repeats 1 --warmup 0 --with '[1]'");
  EXPECT_EQ(junk.code, 2) << junk.out;
}

}  // namespace
