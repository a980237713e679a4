// golden::validate: a golden file checked against its contract before any of its values is read.
#include <cmath>
#include <set>

#include "golden_internal.hpp"
#include "teo/contract.hpp"
#include "teo/golden.hpp"
#include "teo/golden_ops.hpp"

namespace teo::golden {

using safetensors::DType;
using safetensors::File;

namespace detail {

void expect_tensors(const File& f, const std::vector<ExpectedTensor>& want, bool op) {
  const char* what = op ? "the op case" : "the golden";
  const bool kept = f.meta("kept") != nullptr;
  std::set<std::string> known;
  for (const auto& w : want) {
    known.insert(w.name);
    const auto* t = f.find(w.name);
    const std::string plain = w.name.starts_with("ref64.") ? w.name.substr(6) : w.name;
    if (!t) {
      if (w.optional) continue;
      // --keep leaves out computed tensors with their ref64 twins, and only those
      if (kept && is_judged(plain, op)) {
        if (plain != w.name && f.find(plain))
          throw FormatError(std::string(what) + " holds " + plain + " without " + w.name);
        continue;
      }
      throw FormatError(std::string(what) + " has no " + w.name + " " + w.symbolic +
                        ", which its contract requires");
    }
    if (w.name.starts_with("ref64.") && !f.find(plain)) {
      throw FormatError(std::string(what) + " holds " + w.name + " without " + plain);
    }
    if (t->dtype != w.dtype) {
      throw FormatError(std::string(what) + "'s " + w.name + " is " +
                        safetensors::dtype_name(t->dtype) + ", its contract's dtype is " +
                        safetensors::dtype_name(w.dtype));
    }
    if (t->shape != w.shape) {
      throw FormatError(std::string(what) + "'s " + w.name + " has shape " + t->shape_str() +
                        ", its contract's is " + w.symbolic + " = " +
                        safetensors::Tensor{w.name, w.dtype, w.shape, {}}.shape_str());
    }
  }
  for (const auto& t : f.tensors) {
    if (!known.contains(t.name)) {
      throw FormatError(std::string(what) + " holds " + t.name +
                        ", which is not in the contract of its " + (op ? "spec" : "config"));
    }
  }
}

void expect_in_range(const File& f, const std::string& name, std::int64_t hi, bool inclusive,
                     const std::string& bound) {
  const auto* t = f.find(name);
  if (!t) return;
  const auto v = t->int_values();
  for (std::size_t i = 0; i < v.size(); ++i) {
    if (v[i] < 0 || v[i] > hi || (!inclusive && v[i] == hi)) {
      throw FormatError("the golden's " + name + " holds " + std::to_string(v[i]) + " at [" +
                        std::to_string(i) + "], outside [0, " + bound + " = " + std::to_string(hi) +
                        (inclusive ? "]" : ")"));
    }
  }
}

std::set<std::string> contract_names(const File& golden) {
  if (is_op_file(golden)) return op_contract_names(golden);
  const Case c = case_of(golden);
  std::set<std::string> out;
  for (const auto& t : contract::model_case(c.config, c.sizes(), c.dtype == "float32"))
    out.insert(t.name);
  return out;
}

}  // namespace detail

namespace {

void validate_model(const File& f) {
  const Case c = case_of(f);
  const bool f32 = c.dtype == "float32";
  // Every layer holds at least its 8 weights: a config of more layers than the file could describe
  // is refused before its contract is listed (which would take memory in proportion).
  if (c.config.num_layers > static_cast<index_t>(f.tensors.size()) / 8) {
    throw FormatError("the golden's config has " + std::to_string(c.config.num_layers) +
                      " layers, but the file holds only " + std::to_string(f.tensors.size()) +
                      " tensors");
  }
  std::vector<detail::ExpectedTensor> want;
  for (const auto& t : contract::model_case(c.config, c.sizes(), f32))
    want.push_back({t.name, detail::stored_dtype(t.dtype, f32), t.shape, t.symbolic()});
  detail::expect_tensors(f, want, /*op=*/false);
  detail::expect_in_range(f, "input.tokens", c.config.embeddings.vocab_size, false, "vocab_size");
  detail::expect_in_range(f, "input.src_tokens", c.config.embeddings.vocab_size, false,
                          "vocab_size");
  detail::expect_in_range(f, "input.tgt_tokens", c.config.target_vocab(), false,
                          "the decoder's vocabulary");
  detail::expect_in_range(f, "input.generate.tokens", c.config.embeddings.vocab_size, false,
                          "vocab_size");
  if (!c.config.lm())
    detail::expect_in_range(f, "input.labels", c.config.head.num_classes, false, "num_classes");
  if (c.config.patches_input()) {
    for (double x : f.find("input.pixels")->float_values()) {
      if (!std::isfinite(x))
        throw FormatError("the golden's input.pixels holds a non-finite value");
    }
  }
  const bool seq2seq = c.config.encoder_decoder();
  const std::string lengths_name = seq2seq ? "input.src_lengths" : "input.lengths";
  detail::expect_in_range(f, lengths_name, c.seq_len, true, "seq_len");
  const auto case_json = c.case_json();
  const auto lengths = f.find(lengths_name)->values<std::int64_t>();
  if (lengths != case_json.at("lengths").get<std::vector<std::int64_t>>())
    throw FormatError("the golden's " + lengths_name + " are not its case's lengths");
  if (seq2seq) {
    detail::expect_in_range(f, "input.tgt_lengths", c.tgt_len, true, "tgt_len");
    if (f.find("input.tgt_lengths")->values<std::int64_t>() !=
        case_json.at("tgt_lengths").get<std::vector<std::int64_t>>())
      throw FormatError("the golden's input.tgt_lengths are not its case's tgt_lengths");
  }
}

}  // namespace

void validate(const File& golden) {
  const std::string* fmt = golden.meta("format");
  if (!fmt || (*fmt != kFormat && *fmt != kOpFormat)) {
    throw FormatError(std::string("not a teo golden file: __metadata__.format is ") +
                      (fmt ? "\"" + *fmt + "\"" : "missing") + ", expected \"" + kFormat +
                      "\" or \"" + kOpFormat + "\"");
  }
  if (*fmt == kOpFormat)
    detail::validate_op_file(golden);
  else
    validate_model(golden);
}

}  // namespace teo::golden
