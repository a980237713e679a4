#include "cli/train.hpp"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <numeric>
#include <sstream>

#include "cli/plot.hpp"
#include "teo/backend.hpp"
#include "teo/files.hpp"
#include "teo/train.hpp"

namespace teo::cli {

namespace {

using nlohmann::json;
namespace fs = std::filesystem;
namespace st = safetensors;
using namespace teo::train;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

std::string duration(double s) {
  std::ostringstream os;
  const long t = std::lround(std::max(s, 0.0));
  if (t >= 3600)
    os << t / 3600 << "h" << std::setw(2) << std::setfill('0') << (t / 60) % 60 << "m";
  else if (t >= 60)
    os << t / 60 << "m" << std::setw(2) << std::setfill('0') << t % 60 << "s";
  else
    os << t << "s";
  return os.str();
}

// metrics.csv, rewritten whole (atomically) at every row.
struct Metrics {
  std::string path;
  std::vector<std::string> rows;
  void load() {
    std::ifstream in(path);
    std::string line;
    rows.clear();
    while (std::getline(in, line)) {
      if (!line.empty() && !line.starts_with("split,")) rows.push_back(line);
    }
  }
  void add(const std::string& split, index_t epoch, index_t step, double loss, double acc,
           double lr, double tps) {
    std::ostringstream os;
    os << split << "," << epoch << "," << step << "," << std::setprecision(9) << loss << "," << acc
       << "," << lr << "," << std::setprecision(6) << tps;
    rows.push_back(os.str());
    std::string text = "split,epoch,step,loss,accuracy,lr,tokens_per_s\n";
    for (const auto& r : rows) text += r + "\n";
    write_file_atomic(path, text, true);
  }
};

// Running sums between two progress lines.
struct Window {
  double loss = 0, tokens = 0;
  index_t correct = 0, words = 0, steps = 0;
  Clock::time_point start = Clock::now();
};

template <class Real>
int train_typed(TrainOptions o, const Checkpoint* ck, std::ostream& out) {
  const bool tty = o.progress && ::isatty(STDOUT_FILENO);
  const int C = static_cast<int>(languages().size());
  const auto t_data = Clock::now();
  const Dataset data = load_words(o.data);
  const Vocab vocab = ck ? ck->vocab : Vocab::build(data.train);
  o.model.vocab_size = vocab.size();
  o.model.num_classes = C;
  Trainer<Real> trainer =
      ck ? Trainer<Real>(o, load_state<Real>(*ck), ck->position.micro_total) : Trainer<Real>(o);
  Position pos = ck ? ck->position : Position{};
  const fs::path dir(o.out_dir);
  fs::create_directories(dir);
  Metrics metrics{(dir / "metrics.csv").string(), {}};
  if (ck) metrics.load();

  out << "data: " << data.train.size() << " train, " << data.valid.size() << " validation, "
      << data.test.size() << " test words (";
  for (int l = 0; l < C; ++l) {
    const auto k = static_cast<std::size_t>(l);
    out << (l ? ", " : "") << languages()[k].code << " " << data.kept[k];
  }
  out << "; " << std::accumulate(data.dropped_shared.begin(), data.dropped_shared.end(), index_t{0})
      << " entries dropped as shared between lists) in " << std::fixed << std::setprecision(1)
      << seconds_since(t_data) << " s\n";
  out.unsetf(std::ios::floatfield);
  out << "model: " << o.model.to_json().dump() << "\n  " << trainer.params().count()
      << " parameters, " << o.dtype << ", backend " << to_string(backend()) << ", " << num_threads()
      << " thread(s)\n";

  const index_t micro_per_epoch =
      (static_cast<index_t>(data.train.size()) + o.batch_size - 1) / o.batch_size;
  const index_t steps_per_epoch = (micro_per_epoch + o.accum_steps - 1) / o.accum_steps;
  index_t total_steps = steps_per_epoch * o.epochs;
  if (o.max_steps > 0) total_steps = std::min(total_steps, o.max_steps);
  const index_t log_every = std::max<index_t>(1, steps_per_epoch / 20);
  const auto valid = batches_in_order(vocab, data.valid, o.eval_batch, o.model.max_len);

  // The trace: every step's batches, loss, lr and gradient norm, for the exactness test.
  st::File trace;
  if (!o.trace.empty()) {
    trace.metadata = {{"format", "teo-train-trace/1"},
                      {"config", o.model.to_json().dump()},
                      {"train", o.to_json().dump()}};
    add_params(trace, "init.", trainer.params());
  }
  const auto t_start = Clock::now();
  const index_t start_step = pos.step;
  Window w;
  bool stop = pos.step >= total_steps;
  const fs::path latest = dir / "checkpoint.safetensors";
  while (!stop && pos.epoch < o.epochs) {
    const auto order = epoch_batches(data.train, o.batch_size, o.seed, pos.epoch);
    while (!stop && pos.micro < micro_per_epoch) {
      const index_t n_micro = std::min(o.accum_steps, micro_per_epoch - pos.micro);
      std::vector<Batch> micro;
      for (index_t m = 0; m < n_micro; ++m) {
        std::vector<const Example*> ex;
        for (std::size_t i : order[static_cast<std::size_t>(pos.micro + m)])
          ex.push_back(&data.train[i]);
        micro.push_back(make_batch(vocab, ex, o.model.max_len));
        if (!o.trace.empty()) {
          const Batch& b = micro.back();
          const std::string p =
              "step." + std::to_string(pos.step + 1) + "." + std::to_string(m) + ".";
          trace.add<std::int64_t>(p + "tokens", {b.batch, b.seq_len}, b.tokens.data(),
                                  b.tokens.size());
          trace.add<std::int64_t>(p + "lengths", {b.batch}, b.lengths.data(), b.lengths.size());
          trace.add<std::int64_t>(p + "labels", {b.batch}, b.labels.data(), b.labels.size());
        }
      }
      const StepStats s = trainer.step(micro);
      pos = {pos.epoch, pos.micro + n_micro, trainer.steps(), trainer.micro_batches_run()};
      if (!o.trace.empty()) {
        const std::string p = "step." + std::to_string(pos.step) + ".";
        trace.add<double>(p + "loss", {}, &s.loss, 1);
        trace.add<double>(p + "lr", {}, &s.lr, 1);
        trace.add<double>(p + "grad_norm", {}, &s.grad_norm, 1);
      }
      w.loss += s.loss;
      w.tokens += static_cast<double>(s.tokens);
      w.correct += s.correct;
      w.words += s.words;
      ++w.steps;
      stop = o.max_steps > 0 && pos.step >= o.max_steps;
      if (pos.step % log_every == 0 || pos.micro >= micro_per_epoch || stop) {
        const double tps = w.tokens / std::max(seconds_since(w.start), 1e-9);
        const double loss = w.loss / static_cast<double>(w.steps);
        const double acc =
            static_cast<double>(w.correct) / static_cast<double>(std::max<index_t>(w.words, 1));
        metrics.add("train", pos.epoch + 1, pos.step, loss, acc, s.lr, tps);
        const double eta = seconds_since(t_start) / static_cast<double>(pos.step - start_step) *
                           static_cast<double>(total_steps - pos.step);
        std::ostringstream line;
        line << "epoch " << pos.epoch + 1 << "/" << o.epochs << "  step " << pos.step << "/"
             << total_steps << "  loss " << std::fixed << std::setprecision(4) << loss << "  acc "
             << std::setprecision(3) << acc << "  " << std::setprecision(0) << tps << " tok/s  ETA "
             << duration(eta);
        if (tty) {
          const index_t width = 24, filled = width * pos.step / std::max<index_t>(total_steps, 1);
          out << "\r[" << std::string(static_cast<std::size_t>(filled), '#')
              << std::string(static_cast<std::size_t>(width - filled), '.') << "] " << line.str()
              << "   " << std::flush;
        } else {
          out << line.str() << "\n";
        }
        w = Window{};
      }
    }
    if (pos.micro >= micro_per_epoch) {
      if (tty) out << "\n";
      const Evaluation v = trainer.evaluate(valid);
      metrics.add("valid", pos.epoch + 1, pos.step, v.loss, v.accuracy,
                  learning_rate(o.optim, pos.step), 0);
      pos.epoch += 1;
      pos.micro = 0;
      const auto saved_at = dir / ("checkpoint-epoch" + std::to_string(pos.epoch) + ".safetensors");
      save_checkpoint(saved_at.string(), o, vocab, trainer.state(), pos);
      save_checkpoint(latest.string(), o, vocab, trainer.state(), pos);
      out << "epoch " << pos.epoch << ": validation loss " << std::fixed << std::setprecision(4)
          << v.loss << ", accuracy " << v.accuracy << "  (saved " << saved_at.string() << ")\n";
      out.unsetf(std::ios::floatfield);
    }
  }
  if (stop && pos.micro != 0) {
    if (tty) out << "\n";
    save_checkpoint(latest.string(), o, vocab, trainer.state(), pos);
    out << "stopped at step " << pos.step << " (max_steps); saved " << latest.string() << "\n";
  }
  if (!o.trace.empty()) {
    add_params(trace, "final.", trainer.params());
    trace.metadata.emplace_back("steps", std::to_string(pos.step - start_step));
    write_file_atomic(o.trace, st::serialize(trace), true);
    out << "trace: " << o.trace << "\n";
  }

  // The result, and the naive Bayes yardstick on the same split.
  const Evaluation test =
      trainer.evaluate(batches_in_order(vocab, data.test, o.eval_batch, o.model.max_len));
  NaiveBayes nb;
  nb.fit(data.train, C);
  const double nb_acc = nb.accuracy(data.test);
  const double total_s = seconds_since(t_start);
  out << "\ntest accuracy: " << std::fixed << std::setprecision(4) << test.accuracy
      << "   (character-trigram naive Bayes on the same split: " << nb_acc << ")\n";
  out << "confusion matrix (rows: true language, columns: predicted)\n      ";
  for (const auto& l : languages()) out << std::setw(7) << l.code;
  out << "\n";
  for (std::size_t t = 0; t < test.confusion.size(); ++t) {
    out << "  " << std::setw(4) << std::left << languages()[t].code << std::right;
    for (index_t n : test.confusion[t]) out << std::setw(7) << n;
    out << "\n";
  }
  out << "training time " << duration(total_s) << "\n";
  const json summary = {{"test_accuracy", test.accuracy}, {"naive_bayes_test_accuracy", nb_acc},
                        {"test_loss", test.loss},         {"steps", pos.step},
                        {"epochs_completed", pos.epoch},  {"seconds", total_s},
                        {"confusion", test.confusion},    {"languages", languages_json()}};
  write_file_atomic((dir / "summary.json").string(), summary.dump(2) + "\n", true);
  if (o.plot) {
    const std::string png = (dir / "curves.png").string();
    if (plot_curves(metrics.path, png))
      out << "curves: " << png << "\n";
    else
      out << "curves: gnuplot not found (apt-get install gnuplot-nox); metrics are in "
          << metrics.path << "\n";
  }
  out << "metrics: " << metrics.path << "\ncheckpoint: " << latest.string() << "\n";
  out.unsetf(std::ios::floatfield);
  return 0;
}

}  // namespace

int run_train(const TrainOptions& opts, std::ostream& out) {
  if (opts.resume.empty()) {
    opts.validate();
    return opts.dtype == "float64" ? train_typed<double>(opts, nullptr, out)
                                   : train_typed<float>(opts, nullptr, out);
  }
  const Checkpoint ck = read_checkpoint(opts.resume);
  const TrainOptions o = resume_options(ck, opts);
  return o.dtype == "float64" ? train_typed<double>(o, &ck, out) : train_typed<float>(o, &ck, out);
}

int run_predict(const std::string& checkpoint, const std::vector<std::string>& words,
                std::ostream& out) {
  const Checkpoint ck = read_checkpoint(checkpoint);
  const auto& langs = languages();
  if (ck.options.model.num_classes != static_cast<index_t>(langs.size())) {
    throw FormatError(checkpoint + ": the checkpoint has " +
                      std::to_string(ck.options.model.num_classes) + " classes");
  }
  std::vector<Example> ex;
  for (const auto& w : words) {
    bool ok = true;
    auto cps = utf8_decode(w, &ok);
    if (!ok) throw InputError("word \"" + w + "\" is not valid UTF-8");
    if (cps.empty()) throw InputError("an empty word cannot be classified");
    ex.push_back({cps, 0});
  }
  std::vector<const Example*> ptrs;
  for (const auto& e : ex) ptrs.push_back(&e);
  const auto probs =
      predict_from_checkpoint(ck, make_batch(ck.vocab, ptrs, ck.options.model.max_len));
  for (std::size_t i = 0; i < words.size(); ++i) {
    const auto& p = probs[i];
    // The first class on ties, as the accuracy counts it.
    const auto best = static_cast<std::size_t>(std::max_element(p.begin(), p.end()) - p.begin());
    out << words[i] << ": " << langs[best].name << "  ";
    for (std::size_t c = 0; c < p.size(); ++c)
      out << " " << langs[c].code << " " << std::fixed << std::setprecision(3) << p[c];
    out << "\n";
  }
  out.unsetf(std::ios::floatfield);
  return 0;
}

}  // namespace teo::cli
