#include "cli/commands.hpp"

#include <unistd.h>

#include <signal.h>

#include <algorithm>
#include <chrono>
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

// SIGINT or SIGTERM asks the loop to stop after the step in progress; a second one ends the
// process at once.
volatile sig_atomic_t g_stop = 0;
extern "C" void on_stop_signal(int sig) {
  if (g_stop) {
    ::signal(sig, SIG_DFL);
    ::raise(sig);
  }
  g_stop = sig;
}

// Installs on_stop_signal for the lifetime of the loop, then restores what was there.
struct StopSignals {
  struct sigaction old_int {
  }, old_term{};
  StopSignals() {
    struct sigaction sa {};
    sa.sa_handler = on_stop_signal;
    sigemptyset(&sa.sa_mask);
    g_stop = 0;
    sigaction(SIGINT, &sa, &old_int);
    sigaction(SIGTERM, &sa, &old_term);
  }
  ~StopSignals() {
    sigaction(SIGINT, &old_int, nullptr);
    sigaction(SIGTERM, &old_term, nullptr);
  }
};

// Running sums between two progress lines.
struct Window {
  double loss = 0, tokens = 0;
  index_t correct = 0, words = 0, steps = 0;
  Clock::time_point start = Clock::now();
};

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

  const index_t log_every = std::max<index_t>(1, session.steps_per_epoch() / 20);
  const index_t total = session.total_steps();
  const auto t_start = Clock::now();
  Window w;
  std::optional<StopSignals> signals(std::in_place);
  while (!session.done()) {
    if (g_stop) {
      // Interrupted: the step in progress finished; keep it, atomically, and say how to go on.
      const std::string saved = session.save_latest();
      out << (tty ? "\n" : "") << "interrupted at step " << session.position().step << "; saved "
          << saved << " (continue with --resume " << saved << ")\n";
      return 130;
    }
    const StepStats s = session.step();
    const Position& pos = session.position();
    w.loss += s.loss;
    w.tokens += static_cast<double>(s.tokens);
    w.correct += s.correct;
    w.words += s.words;
    ++w.steps;
    if (pos.step % log_every == 0 || session.epoch_done() || session.done()) {
      const double tps = w.tokens / std::max(seconds_since(w.start), 1e-9);
      const double loss = w.loss / static_cast<double>(w.steps);
      const double acc =
          static_cast<double>(w.correct) / static_cast<double>(std::max<index_t>(w.words, 1));
      session.metrics().add("train", pos.epoch + 1, pos.step, loss, acc, s.lr, tps);
      const double eta = seconds_since(t_start) /
                         static_cast<double>(pos.step - session.first_step()) *
                         static_cast<double>(total - pos.step);
      std::ostringstream line;
      line << "epoch " << pos.epoch + 1 << "/" << o.epochs << "  step " << pos.step << "/" << total
           << "  loss " << std::fixed << std::setprecision(4) << loss << "  acc "
           << std::setprecision(3) << acc << "  " << std::setprecision(0) << tps << " tok/s  ETA "
           << duration(eta);
      if (tty) {
        const index_t width = 24, filled = width * pos.step / std::max<index_t>(total, 1);
        out << "\r[" << std::string(static_cast<std::size_t>(filled), '#')
            << std::string(static_cast<std::size_t>(width - filled), '.') << "] " << line.str()
            << "   " << std::flush;
      } else {
        out << line.str() << "\n";
      }
      w = Window{};
    }
    if (session.epoch_done()) {
      if (tty) out << "\n";
      const auto [v, saved_at] = session.end_epoch();
      out << "epoch " << session.position().epoch << ": validation loss " << std::fixed
          << std::setprecision(4) << v.loss << ", accuracy " << v.accuracy << "  (saved "
          << saved_at << ")\n";
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
  if (ck.options.model.num_classes != static_cast<index_t>(langs.size())) {
    throw FormatError(checkpoint + ": the checkpoint has " +
                      std::to_string(ck.options.model.num_classes) + " classes");
  }
  const auto probs =
      predict_from_checkpoint(ck, encode_words(ck.vocab, words, ck.options.model.max_len));
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
