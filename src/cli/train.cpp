#include "cli/commands.hpp"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <iomanip>
#include <numeric>
#include <optional>
#include <sstream>

#include "teo/backend.hpp"
#include "teo/train.hpp"

namespace teo::cli {

namespace {

namespace fs = std::filesystem;
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

template <class Real>
int train_typed(const TrainOptions& opts, const Checkpoint* ck, std::ostream& out) {
  const bool tty = opts.progress && ::isatty(STDOUT_FILENO);
  const auto t_data = Clock::now();
  Session<Real> session(opts, ck);
  const TrainOptions& o = session.options();
  const Dataset& data = session.data();
  out << "data: " << data.train.size() << " train, " << data.valid.size() << " validation, "
      << data.test.size() << " test words (";
  for (std::size_t l = 0; l < languages().size(); ++l)
    out << (l ? ", " : "") << languages()[l].code << " " << data.kept[l];
  out << "; " << std::accumulate(data.dropped_shared.begin(), data.dropped_shared.end(), index_t{0})
      << " entries dropped as shared between lists) in " << std::fixed << std::setprecision(1)
      << seconds_since(t_data) << " s\n";
  out.unsetf(std::ios::floatfield);
  out << "model: " << o.model.to_json().dump() << "\n  " << session.trainer().params().count()
      << " parameters, " << o.dtype << ", backend " << to_string(backend()) << ", " << num_threads()
      << " thread(s)\n";

  const index_t total = session.total_steps();
  const auto t_start = Clock::now();
  std::optional<StopSignals> signals(std::in_place);
  while (!session.done()) {
    if (StopSignals::requested()) {
      // Interrupted: the step in progress finished; keep it, atomically, and say how to go on.
      const std::string saved = session.save_latest();
      out << (tty ? "\n" : "") << "interrupted at step " << session.position().step << "; saved "
          << saved << " (continue with --resume " << saved << ")\n";
      return 130;
    }
    const Progress p = session.step().progress;
    if (p.logged) {
      const Position& pos = session.position();
      std::ostringstream line;
      line << "epoch " << pos.epoch + 1 << "/" << o.epochs << "  step " << pos.step << "/" << total
           << "  loss " << std::fixed << std::setprecision(4) << p.loss << "  acc "
           << std::setprecision(3) << p.accuracy << "  " << std::setprecision(0) << p.tokens_per_s
           << " tok/s  ETA " << duration(p.eta_seconds);
      if (tty) {
        const index_t width = 24, filled = width * pos.step / std::max<index_t>(total, 1);
        out << "\r[" << std::string(static_cast<std::size_t>(filled), '#')
            << std::string(static_cast<std::size_t>(width - filled), '.') << "] " << line.str()
            << "   " << std::flush;
      } else {
        out << line.str() << "\n";
      }
    }
    if (session.epoch_done()) {
      if (tty) out << "\n";
      const auto [v, saved_at] = session.end_epoch();
      out << "epoch " << session.position().epoch << ": validation loss " << std::fixed
          << std::setprecision(4) << v.loss;
      if (o.model.decoder()) {
        out << " (perplexity " << std::exp(v.loss) << "), next-token accuracy " << v.accuracy;
      } else {
        out << ", accuracy " << v.accuracy;
      }
      out << "  (saved " << saved_at << ")\n";
      out.unsetf(std::ios::floatfield);
    }
  }
  signals.reset();
  const std::string latest = (fs::path(o.out_dir) / "checkpoint.safetensors").string();
  if (session.position().micro != 0) {
    if (tty) out << "\n";
    session.save_latest();
    out << "stopped at step " << session.position().step << " (max_steps); saved " << latest
        << "\n";
  }
  if (!o.trace.empty()) out << "trace: " << o.trace << "\n";

  const Summary sum = session.finish();
  if (o.model.decoder()) {
    out << "\ntest perplexity: " << std::fixed << std::setprecision(4) << sum.test_perplexity
        << " per character   (character-trigram model on the same split: " << sum.trigram_perplexity
        << ")\nnext-token accuracy " << sum.test.accuracy << " over " << sum.test.predictions
        << " test tokens\n";
  } else {
    out << "\ntest accuracy: " << std::fixed << std::setprecision(4) << sum.test.accuracy
        << "   (character-trigram naive Bayes on the same split: " << sum.naive_bayes_accuracy
        << ")\nconfusion matrix (rows: true language, columns: predicted)\n      ";
    for (const auto& l : languages()) out << std::setw(7) << l.code;
    out << "\n";
    for (std::size_t t = 0; t < sum.test.confusion.size(); ++t) {
      out << "  " << std::setw(4) << std::left << languages()[t].code << std::right;
      for (index_t n : sum.test.confusion[t]) out << std::setw(7) << n;
      out << "\n";
    }
  }
  out << "training time " << duration(seconds_since(t_start)) << "\n";
  const std::string csv = session.metrics().path(),
                    png = (fs::path(o.out_dir) / "curves.png").string();
  if (o.plot && plot_curves(csv, png))
    out << "curves: " << png << "\n";
  else if (o.plot)
    out << "curves: gnuplot not found (apt-get install gnuplot-nox); metrics are in " << csv
        << "\n";
  out << "metrics: " << csv << "\ncheckpoint: " << latest << "\n";
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
  if (ck.options.model.decoder()) {
    throw ConfigError(checkpoint +
                      ": the checkpoint is a language model (architecture \"decoder\"); teo "
                      "predict classifies words with an encoder's checkpoint");
  }
  if (ck.options.model.head.num_classes != static_cast<index_t>(langs.size())) {
    throw FormatError(checkpoint + ": the checkpoint has " +
                      std::to_string(ck.options.model.head.num_classes) + " classes");
  }
  const auto probs = predict_from_checkpoint(
      ck, encode_words(ck.vocab, words, ck.options.model.embeddings.max_len));
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
