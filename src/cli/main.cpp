// The `teo` command.
#include <cstdio>
#include <iostream>
#include <new>
#include <string>

#include <CLI/CLI.hpp>

#include "teo/cli/shapes.hpp"
#include "teo/errors.hpp"

int main(int argc, char** argv) {
  CLI::App app{"teo: a CPU reference implementation and test oracle for the Transformer encoder"};
  app.require_subcommand(1);
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
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  try {
    if (*shapes) return teo::cli::run_shapes(shapes_opts, std::cout);
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
