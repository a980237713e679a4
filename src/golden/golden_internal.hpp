// Internal to src/golden: the rules the generator and the checker share.
#pragma once

#include <string>
#include <vector>

#include "teo/golden.hpp"

namespace teo::golden::detail {

// A float32 golden's tolerance for its own error against float64: at most
// kIllConditioned * FLT_EPSILON * sqrt(L) relative to each tensor's scale, where L is the case's
// longest reduction: max(d_model, d_ff, seq_len, batch * seq_len).
inline constexpr double kIllConditioned = 16.0;
// An emulated error above this fraction of a tensor's scale makes its budget vacuous.
inline constexpr double kVacuous = 0.1;

// The float64 truth of golden tensor g: ref64.<name> in a float32 golden (FormatError when it is
// missing or misshapen), g itself in a float64 one.
std::vector<double> truth_of(const safetensors::File& golden, const safetensors::Tensor& g,
                             bool f32);

// The scale errors are measured against: max |truth| over finite entries; for a bias gradient at
// least the largest of its weight gradient's truth (see check.cpp).
double scale_of(const safetensors::File& golden, const std::string& name,
                const std::vector<double>& truth, bool f32);

// max |x - truth| over the entries where the truth is finite; infinite when x is not finite at
// one of them.
double max_abs_diff(const std::vector<double>& x, const std::vector<double>& truth);

// The name of the activation max pooling reads: act.final_norm (pre-norm), the last layer's
// output, or act.input without layers.
std::string pooled_input_name(const EncoderConfig& cfg);

// Whether a contract tensor's value depends on which position max pooling picked: every gradient
// upstream of the pooling (not loss, logits, pooled or the head's).
bool behind_pooling_argmax(const std::string& name);

// Under max pooling: "" when in every (sequence, feature) column the two largest values of the
// pooled activation's truth (over the real positions) are further apart than twice the sum of
// the emulated run's errors at those two positions (a run twice as noisy there could swap them),
// else the first column where they are not, as "column (b, d): values x and y".
std::string ambiguous_pooling(const safetensors::File& golden, const EncoderConfig& cfg,
                              const std::vector<double>& top_truth,
                              const std::vector<double>& top_emulated);

// The cause of a float32 error that is not at rounding level, from the golden's float32 and
// float64 activations: a max-pooling argmax that differs, a ReLU input whose sign differs, or
// neither.
std::string ill_conditioning_cause(const safetensors::File& golden, const EncoderConfig& cfg);

}  // namespace teo::golden::detail
