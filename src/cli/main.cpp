// The `teo` command.
#include <cstdio>
#include <iostream>
#include <new>
#include <optional>
#include <string>

#include <CLI/CLI.hpp>

#include "teo/backend.hpp"
#include "teo/cli/bench.hpp"
#include "teo/cli/shapes.hpp"
#include "teo/errors.hpp"

int main(int argc, char** argv) {
  CLI::App app{"teo: a CPU reference implementation and test oracle for the Transformer encoder"};
  app.require_subcommand(1);
  std::string backend_flag, isa_flag;
  std::optional<int> threads_flag;
  // Execution settings for every command; TEO_BACKEND, TEO_ISA and TEO_NUM_THREADS set the same
  // things, and a flag wins over its variable.
  app.add_option("--backend", backend_flag,
                 "reference | simd | blas (default: reference, or TEO_BACKEND)");
  app.add_option("--isa", isa_flag,
                 "avx512 | avx2 | neon | scalar (default: best here, or TEO_ISA)");
  app.add_option("--threads", threads_flag,
                 "thread count (default: all cores, or TEO_NUM_THREADS)");

  teo::cli::ShapesOptions shapes_opts;
  CLI::App* shapes = app.add_subcommand(
      "shapes", "Run forward and backward and print every stage's shape, tokens to loss and back");
  shapes->add_option("--config", shapes_opts.config_path, "EncoderConfig JSON (default: built-in)")
      ->check(CLI::ExistingFile);
  shapes->add_option("--batch", shapes_opts.batch, "batch size")->check(CLI::Range(0, 1 << 20));
  shapes->add_option("--seq-len", shapes_opts.seq_len, "sequence length (default: min(8, max_len))")
      ->check(CLI::Range(1, 1 << 20));
  shapes->add_option("--dtype", shapes_opts.dtype, "float32 or float64")
      ->check(CLI::IsMember({"float32", "float64"}));

  teo::cli::BenchOptions bench_opts;
  CLI::App* bench = app.add_subcommand(
      "bench", "Time forward and forward+backward on a preset, per stage, with GFLOP/s");
  bench->add_option("--preset", bench_opts.preset, "bert-base or small (default small)")
      ->check(CLI::IsMember({"bert-base", "small"}));
  bench->add_option("--dtype", bench_opts.dtype, "float32 or float64 (default float32)")
      ->check(CLI::IsMember({"float32", "float64"}));
  bench->add_option("--repeats", bench_opts.repeats, "timed runs; medians are reported")
      ->check(CLI::Range(1, 1000));
  bench->add_option("--warmup", bench_opts.warmup, "untimed runs first")->check(CLI::Range(0, 100));
  bench->add_flag("--json", bench_opts.json, "print one JSON line");
  for (CLI::App* sub : {shapes, bench}) {
    sub->add_option("--backend", backend_flag, "reference | simd | blas");
    sub->add_option("--isa", isa_flag, "avx512 | avx2 | neon | scalar");
    sub->add_option("--threads", threads_flag, "thread count");
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  try {
    teo::init_from_environment();
    if (*bench && backend_flag.empty() && !std::getenv("TEO_BACKEND")) {
      teo::set_backend(teo::Backend::simd);  // benchmarks measure the fast path by default
    }
    if (!backend_flag.empty()) teo::set_backend(teo::parse_backend(backend_flag, "--backend"));
    if (!isa_flag.empty()) teo::set_isa(teo::parse_isa(isa_flag, "--isa"));
    if (threads_flag) teo::set_num_threads(*threads_flag);
    if (*shapes) return teo::cli::run_shapes(shapes_opts, std::cout);
    if (*bench) return teo::cli::run_bench(bench_opts, std::cout);
  } catch (const teo::Error& e) {
    std::cerr << "teo: error: " << e.what() << "\n";
    return 2;
  } catch (const std::bad_alloc&) {
    std::cerr << "teo: error: out of memory: the config or batch is too large for this machine\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "teo: error: " << e.what() << "\n";
    return 2;
  }
  return 0;
}
