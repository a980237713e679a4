#include "teo/train/log.hpp"

#include <cstdlib>
#include <fstream>
#include <iomanip>
#include <sstream>

#include "teo/files.hpp"

namespace teo::train {

void MetricsLog::load(index_t up_to_step) {
  std::ifstream in(path_);
  std::string line;
  rows_.clear();
  while (std::getline(in, line)) {
    if (line.empty() || line.starts_with("split,")) continue;
    // split,epoch,step,...: a row whose step does not parse is not ours, and is dropped too.
    std::istringstream fields(line);
    std::string split, epoch, step;
    std::getline(fields, split, ',');
    std::getline(fields, epoch, ',');
    std::getline(fields, step, ',');
    char* end = nullptr;
    const long long s = std::strtoll(step.c_str(), &end, 10);
    if (!step.empty() && *end == '\0' && s <= up_to_step) rows_.push_back(line);
  }
}

void MetricsLog::add(const std::string& split, index_t epoch, index_t step, double loss,
                     double accuracy, double lr, double tokens_per_s) {
  std::ostringstream os;
  os << split << "," << epoch << "," << step << "," << std::setprecision(9) << loss << ","
     << accuracy << "," << lr << "," << std::setprecision(6) << tokens_per_s;
  rows_.push_back(os.str());
  std::string text = "split,epoch,step,loss,accuracy,lr,tokens_per_s\n";
  for (const auto& r : rows_) text += r + "\n";
  write_file_atomic(path_, text, true);
}

template <class Real>
Trace::Trace(const TrainOptions& o, const Params<Real>& init) {
  file_.metadata = {{"format", "teo-train-trace/1"},
                    {"config", o.model.to_json().dump()},
                    {"train", o.to_json().dump()}};
  add_params(file_, "init.", init);
}

void Trace::add_batches(index_t step, const std::vector<Batch>& micro_batches) {
  for (std::size_t m = 0; m < micro_batches.size(); ++m) {
    const Batch& b = micro_batches[m];
    const std::string p = "step." + std::to_string(step) + "." + std::to_string(m) + ".";
    file_.add<std::int64_t>(p + "tokens", {b.batch, b.seq_len}, b.tokens.data(), b.tokens.size());
    file_.add<std::int64_t>(p + "lengths", {b.batch}, b.lengths.data(), b.lengths.size());
    // a decoder's batch has no labels: its targets are its next tokens
    if (!b.labels.empty())
      file_.add<std::int64_t>(p + "labels", {b.batch}, b.labels.data(), b.labels.size());
  }
}

void Trace::add_stats(index_t step, const StepStats& s) {
  const std::string p = "step." + std::to_string(step) + ".";
  file_.add<double>(p + "loss", {}, &s.loss, 1);
  file_.add<double>(p + "lr", {}, &s.lr, 1);
  file_.add<double>(p + "grad_norm", {}, &s.grad_norm, 1);
}

template <class Real>
void Trace::write(const std::string& path, const Params<Real>& final, index_t steps) {
  add_params(file_, "final.", final);
  file_.metadata.emplace_back("steps", std::to_string(steps));
  write_file_atomic(path, safetensors::serialize(file_), true);
}

template Trace::Trace(const TrainOptions&, const Params<float>&);
template Trace::Trace(const TrainOptions&, const Params<double>&);
template void Trace::write(const std::string&, const Params<float>&, index_t);
template void Trace::write(const std::string&, const Params<double>&, index_t);

}  // namespace teo::train
