// The `teo` command.
#include <malloc.h>

#include <iostream>
#include <map>
#include <new>
#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "cli/commands.hpp"
#include "teo/backend.hpp"
#include "teo/errors.hpp"
#include "teo/golden_ops.hpp"
#include "teo/suggest.hpp"

namespace {

// The names a user may type for app's options ("--candidate", "-h") and subcommands.
std::vector<std::string> option_names(const CLI::App& app) {
  std::vector<std::string> out;
  for (const CLI::Option* o : app.get_options()) {
    for (const auto& n : o->get_lnames()) out.push_back("--" + n);
    for (const auto& n : o->get_snames()) out.push_back("-" + n);
  }
  return out;
}

// For a command line CLI11 refused: the first flag or command that does not exist, named with the
// closest valid one ("unknown flag --candidte for `teo golden check`; did you mean
// \"--candidate\"?"), or "" when every name exists (CLI11's own message then says what is wrong).
// CLI11 alone would report a missing required flag first, or "A subcommand is required".
std::string unknown_name(CLI::App& app, int argc, char** argv) {
  CLI::App* cur = &app;
  std::string path = "teo";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--") break;
    if (a.size() > 1 && a[0] == '-') {
      const std::string name = a.substr(0, a.find('='));
      const CLI::Option* opt = cur->get_option_no_throw(name);
      if (!opt) {
        for (const CLI::App* up = cur->get_parent(); up; up = up->get_parent()) {
          if (up->get_option_no_throw(name)) {
            return name + " is a flag of `" + (up->get_parent() ? up->get_name() : "teo") +
                   "`, not of `" + path + "`: give it before the subcommand";
          }
        }
        return "unknown flag " + name + " for `" + path + "`" +
               teo::did_you_mean(name, option_names(*cur)) + " (see `" + path + " --help`)";
      }
      if (a.find('=') == std::string::npos && opt->get_items_expected_max() > 0) ++i;  // value
      continue;
    }
    const auto subs = cur->get_subcommands([](CLI::App*) { return true; });
    if (subs.empty()) continue;  // a positional argument (predict's words)
    CLI::App* next = nullptr;
    std::vector<std::string> names;
    for (CLI::App* sub : subs) {
      names.push_back(sub->get_name());
      if (sub->get_name() == a) next = sub;
    }
    if (!next) {
      std::string all;
      for (const auto& n : names) all += (all.empty() ? "" : ", ") + n;
      return "unknown command \"" + a + "\" for `" + path + "`" + teo::did_you_mean(a, names) +
             " (the commands are " + all + ")";
    }
    cur = next;
    path += " " + a;
  }
  return "";
}

}  // namespace

int main(int argc, char** argv) {
  // Activations are freed and reallocated at every step with shapes that vary with the batch.
  // Served by mmap, each would come back as fresh pages that the kernel zeroes on first touch
  // (a quarter of a training run's time); from the heap, freed memory is reused.
  mallopt(M_MMAP_THRESHOLD, 256 << 20);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
  CLI::App app{"teo: a CPU reference implementation and test oracle for the Transformer encoder"};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string("teo ") + TEO_VERSION);
  std::string backend_flag, isa_flag;
  std::optional<int> threads_flag;
  // Execution settings for every command; TEO_BACKEND, TEO_ISA and TEO_NUM_THREADS set the same
  // things, and a flag wins over its variable.
  app.add_option("--backend", backend_flag,
                 "reference | simd | blas (default: TEO_BACKEND, else simd for train and bench "
                 "and reference for the rest)");
  app.add_option("--isa", isa_flag,
                 "avx512 | avx2 | neon | scalar (default: best here, or TEO_ISA)");
  app.add_option("--threads", threads_flag,
                 "thread count (default: all cores, or TEO_NUM_THREADS)");

  teo::cli::ShapesOptions shapes_opts;
  CLI::App* shapes = app.add_subcommand(
      "shapes", "Run forward and backward and print every stage's shape, tokens to loss and back");
  shapes->add_option("--config", shapes_opts.config_path, "ModelConfig JSON (default: built-in)")
      ->check(CLI::ExistingFile);
  shapes->add_option("--batch", shapes_opts.batch, "batch size")->check(CLI::Range(0, 1 << 20));
  shapes->add_option("--seq-len", shapes_opts.seq_len, "sequence length (default: min(8, max_len))")
      ->check(CLI::Range(1, 1 << 20));
  shapes->add_option("--dtype", shapes_opts.dtype, "float32 or float64")
      ->check(CLI::IsMember({"float32", "float64"}));
  shapes
      ->add_option("--steps", shapes_opts.steps,
                   "a decoder's greedy steps after the prompt (generation tensors)")
      ->check(CLI::Range(0, 1 << 20));
  shapes
      ->add_option("--tgt-len", shapes_opts.tgt_len,
                   "an encoder_decoder's target length (default: the sequence length)")
      ->check(CLI::Range(1, 1 << 20));

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
  bench->add_option("--with", bench_opts.with,
                    "config keys over the preset's, as a JSON object (e.g. "
                    "'{\"num_kv_heads\": 4, \"positional\": \"rope\"}'); the plain preset is "
                    "timed too and the cost printed");
  bench->add_option(
      "--precision", bench_opts.precision,
      "tf32, bf16, fp16 or fp8 (also timing bf16): also time the emulated pass and print its cost");
  CLI::App* golden =
      app.add_subcommand("golden", "Write golden files, or check a backend's output against them");
  golden->require_subcommand(1);
  teo::cli::GoldenGenerateOptions gen_opts;
  CLI::App* gen = golden->add_subcommand(
      "generate", "Write one golden case (--config, --out), or regenerate a corpus (--corpus)");
  auto* gen_config =
      gen->add_option("--config", gen_opts.config_path, "CASE.json: config keys plus \"case\"");
  auto* gen_out = gen->add_option("--out", gen_opts.out_path, "the .safetensors file to write");
  auto* gen_corpus =
      gen->add_option("--corpus", gen_opts.corpus_dir,
                      "a directory with cases.json; rewrites its files and manifest");
  gen_config->needs(gen_out);
  gen_out->needs(gen_config);
  gen_corpus->excludes(gen_config)->excludes(gen_out);
  gen->add_flag("--force", gen_opts.force, "overwrite an existing --out file or corpus");
  gen->add_option("--keep", gen_opts.keep,
                  "store only the computed tensors matching these comma-separated globs, e.g. "
                  "'act.layers.*.output,act.logits,act.loss,grad.*' (default: all)");
  gen->add_flag("--allow-ill-conditioned", gen_opts.allow_ill_conditioned,
                "write a float32 case whose own error is not at rounding level, marked in its "
                "metadata (refused otherwise)");
  bool gen_no_progress = false;
  gen->add_flag("--no-progress", gen_no_progress, "no stage lines on standard error");
  gen->add_option("--weights", gen_opts.weights,
                  "a checkpoint (.safetensors) whose parameters replace the seed's; needs --names");
  gen->add_option("--names", gen_opts.names,
                  "the checkpoint's name map: hf-bert, or a map file (docs/models.md)");
  gen->add_option("--hf-config", gen_opts.hf_config,
                  "the checkpoint's config.json: the model's config (CASE.json then gives "
                  "\"case\" and any key over it)");
  teo::cli::GoldenExportOptions export_opts;
  CLI::App* exp = golden->add_subcommand(
      "export", "Write a golden's parameters under a checkpoint family's names (and config.json)");
  exp->add_option("--golden", export_opts.golden, "a model case's golden file")->required();
  exp->add_option("--names", export_opts.names, "hf-bert, or a map file (docs/models.md)")
      ->required();
  exp->add_option("--out", export_opts.out_path, "the .safetensors checkpoint to write")
      ->required();
  exp->add_option("--hf-config", export_opts.hf_config_path, "also write its config.json here");
  exp->add_flag("--force", export_opts.force, "overwrite existing files");
  teo::cli::GoldenOpOptions op_opts;
  CLI::App* op = golden->add_subcommand(
      "op", "Write one op case: a single operator's inputs, outputs and exact backward");
  std::string ops_help;
  for (const auto& name : teo::golden::op_names())
    ops_help += (ops_help.empty() ? "" : " | ") + name;
  op->add_option("--op", op_opts.op, ops_help + " (or the spec's \"op\")");
  op->add_option("--spec", op_opts.spec_path, "SPEC.json: shapes, options, dtype, seed")
      ->required();
  op->add_option("--out", op_opts.out_path, "the .safetensors file to write")->required();
  op->add_flag("--force", op_opts.force, "overwrite an existing --out file");
  op->add_option("--keep", op_opts.keep,
                 "store only the outputs and gradients matching these comma-separated globs; "
                 "in an fp8 linear case fp8.* adds the quantized operands (e.g. '*')");
  op->add_flag("--allow-ill-conditioned", op_opts.allow_ill_conditioned,
               "write a float32 case whose own error is not at rounding level, marked as such");
  std::string list_path = "golden";
  CLI::App* list = golden->add_subcommand(
      "list", "Print each case of a golden directory and the tensors a candidate writes");
  list->add_option("--golden", list_path, "golden file or directory (default golden)");
  teo::cli::GoldenCheckOptions check_opts;
  CLI::App* check = golden->add_subcommand(
      "check", "Compare a candidate's tensors with a golden's and name the first divergence");
  check->add_option("--golden", check_opts.golden, "golden file or directory")->required();
  check->add_option("--candidate", check_opts.candidate, "candidate file or directory")->required();
  check->add_option("--only", check_opts.only, "forward | backward (default: both)")
      ->check(CLI::IsMember({"all", "forward", "backward"}));
  check->add_option("--junit", check_opts.junit_path, "also write a JUnit XML report here");
  check->add_option("--json", check_opts.json_path, "also write a JSON report here");
  check->add_flag("--require-all", check_opts.require_all,
                  "fail when a golden tensor is missing from the candidate");
  check->add_flag("--allow-extra", check_opts.tolerances.allow_extra,
                  "accept candidate tensors (and, for directories, files) the golden does not "
                  "name, instead of failing on them as misspellings");
  check->add_option("--names", check_opts.names,
                    "the candidate may name parameter gradients by this checkpoint family's names "
                    "(hf-bert, or a map file)");
  check->add_flag("--hide-unchecked", check_opts.hide_unchecked,
                  "leave the rows of tensors not in the candidate out of the text report");
  bool check_no_progress = false;
  check->add_flag("--no-progress", check_no_progress, "no progress on standard error");
  check->add_option("--rtol", check_opts.tolerances.rtol, "float64: relative tolerance (1e-9)")
      ->check(CLI::NonNegativeNumber);
  check->add_option("--atol", check_opts.tolerances.atol, "float64: absolute tolerance (1e-12)")
      ->check(CLI::NonNegativeNumber);
  check
      ->add_option("--k", check_opts.tolerances.k,
                   "float32: multiple of teo's own float32 error (4)")
      ->check(CLI::NonNegativeNumber);
  check
      ->add_option("--floor-eps", check_opts.tolerances.floor_eps,
                   "float32: floor in units of FLT_EPSILON * max|ref64| (8)")
      ->check(CLI::NonNegativeNumber);
  check->add_option("--precision", check_opts.precision,
                    "what the candidate computed in: fp64, fp32, tf32, bf16, fp16 or fp8 "
                    "(default: implied by BF16/F16 tensors, else the golden's dtype)");
  check
      ->add_option("--budget-k", check_opts.tolerances.budget_k,
                   "tf32/bf16/fp16/fp8: multiple of the emulated run's error (8)")
      ->check(CLI::NonNegativeNumber);
  check
      ->add_option("--budget-floor", check_opts.tolerances.budget_floor,
                   "tf32/bf16/fp16/fp8: floor in units of the storage format's u * scale (4)")
      ->check(CLI::NonNegativeNumber);
  check
      ->add_option("--fp8-recipe-k", check_opts.tolerances.fp8_recipe_k,
                   "fp8: how far from the emulated run, in units of its error (0.5; inf: no "
                   "recipe rule)")
      ->check(CLI::Validator(
          [](std::string& v) -> std::string {
            // CLI11's NonNegativeNumber stops at the largest double: inf is allowed here
            double x = 0;
            if (!CLI::detail::lexical_cast(v, x) || !(x >= 0))
              return "must be a number >= 0 or inf";
            return "";
          },
          "NONNEGATIVE or inf"));
  CLI::App* train = app.add_subcommand(
      "train", "Train the encoder to tell which language a word is (the CPU training demo)");
  std::string train_config;
  std::map<std::string, std::string> train_flags;
  std::vector<std::pair<const teo::train::TrainKey*, CLI::Option*>> train_flag_options;
  teo::train::TrainOptions train_opts;
  train->add_option("--config", train_config, "JSON file with any of the keys below")
      ->check(CLI::ExistingFile);
  for (const auto& k : teo::train::train_keys()) {
    train_flag_options.emplace_back(&k,
                                    train->add_option(teo::train::flag_name(k), train_flags[k.key],
                                                      teo::train::help_text(k, train_opts)));
  }
  train->add_option("--out", train_opts.out_dir, "output directory (default train-out)");
  train->add_option("--resume", train_opts.resume, "continue from this checkpoint")
      ->check(CLI::ExistingFile);
  train->add_option("--trace", train_opts.trace,
                    "write every step's batches, loss, lr and gradient norm to this file");
  bool no_progress = false, no_plot = false;
  train->add_flag("--no-progress", no_progress, "plain lines even on a terminal");
  train->add_flag("--no-plot", no_plot, "do not draw curves.png");
  std::string predict_ckpt;
  std::vector<std::string> predict_words;
  CLI::App* predict =
      app.add_subcommand("predict", "Print each word's language probabilities from a checkpoint");
  predict->add_option("--checkpoint", predict_ckpt, "a teo train checkpoint")->required();
  predict->add_option("words", predict_words, "words to classify")->required();
  teo::cli::GgufOptions gguf_opts;
  CLI::App* gguf = teo::cli::add_gguf_commands(app, gguf_opts);
  teo::cli::QuantOptions quant_opts;
  CLI::App* quant = teo::cli::add_quant_commands(app, quant_opts);
  for (CLI::App* sub :
       {shapes, bench, golden, gen, exp, op, list, check, train, predict, gguf, quant}) {
    const bool fast = sub == bench || sub == train;  // they time or train: the fast path
    sub->add_option("--backend", backend_flag,
                    std::string("reference | simd | blas (default: TEO_BACKEND, else ") +
                        (fast ? "simd)" : "reference)"));
    sub->add_option("--isa", isa_flag, "avx512 | avx2 | neon | scalar");
    sub->add_option("--threads", threads_flag, "thread count");
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help: the help text, exit 0
    // A bad, missing or conflicting flag: one line, exit 2. A name that does not exist is named
    // first, with the closest one that does.
    if (const std::string unknown = unknown_name(app, argc, argv); !unknown.empty()) {
      std::cerr << "teo: error: " << unknown << "\n";
      return 2;
    }
    std::cerr << "teo: error: " << e.what() << " (see --help)\n";
    return 2;
  }
  // The exit status: 0 success, 1 a failed check, 2 bad input (or a failed write), 3 training
  // diverged, 130 interrupted (training saved a checkpoint to resume from; golden generate wrote
  // nothing).
  const auto run = [&]() -> int {
    teo::init_from_environment();
    if (*bench && backend_flag.empty() && !std::getenv("TEO_BACKEND")) {
      teo::set_backend(teo::Backend::simd);  // benchmarks measure the fast path by default
    }
    if (!backend_flag.empty()) teo::set_backend(teo::parse_backend(backend_flag, "--backend"));
    if (!isa_flag.empty()) teo::set_isa(teo::parse_isa(isa_flag, "--isa"));
    if (threads_flag) teo::set_num_threads(*threads_flag);
    if (*shapes) return teo::cli::run_shapes(shapes_opts, std::cout);
    if (*bench) return teo::cli::run_bench(bench_opts, std::cout);
    gen_opts.progress = !gen_no_progress;
    check_opts.progress = !check_no_progress;
    if (*gen) return teo::cli::run_golden_generate(gen_opts, std::cout);
    if (*op) return teo::cli::run_golden_op(op_opts, std::cout);
    if (*exp) return teo::cli::run_golden_export(export_opts, std::cout);
    if (*list) return teo::cli::run_golden_list(list_path, std::cout);
    if (*train) {
      if (backend_flag.empty() && !std::getenv("TEO_BACKEND")) {
        teo::set_backend(teo::Backend::simd);  // training runs the fast path by default
      }
      nlohmann::json given = train_config.empty()
                                 ? nlohmann::json::object()
                                 : teo::train::TrainOptions::read_keys(train_config);
      for (const auto& [key, option] : train_flag_options) {
        if (option->count())
          given[key->key] = teo::train::parse_flag_value(*key, train_flags[key->key]);
      }
      train_opts.apply_json(given);
      train_opts.given = given;
      train_opts.progress = !no_progress;
      train_opts.plot = !no_plot;
      return teo::cli::run_train(train_opts, std::cout);
    }
    if (*predict) return teo::cli::run_predict(predict_ckpt, predict_words, std::cout);
    if (*check) return teo::cli::run_golden_check(check_opts, std::cout);
    if (*gguf) return teo::cli::run_gguf(gguf_opts, std::cout);
    if (*quant) return teo::cli::run_quant(quant_opts, std::cout);
    return 0;
  };
  try {
    const int rc = run();
    // A full disk or a closed pipe must not end in success.
    if (!std::cout.flush()) {
      std::cerr << "teo: error: cannot write to standard output\n";
      return rc == 0 ? 2 : rc;
    }
    return rc;
  } catch (const teo::TrainingDiverged& e) {
    std::cerr << "teo: error: " << e.what() << "\n";
    return 3;
  } catch (const teo::Interrupted& e) {
    std::cerr << "teo: " << e.what() << "\n";
    return 130;
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
}
