// The checker's judgement of a routed case's routing (docs/golden-format.md, "Routing"): the
// experts each token chose, exactly, an ambiguous routing told from a wrong one, and what an
// ambiguous token contaminates.
#pragma once

#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "golden_internal.hpp"
#include "teo/golden.hpp"
#include "teo/precision.hpp"
#include "teo/safetensors.hpp"

namespace teo::golden::detail {

// A routed case's output.topk_ids, judged exactly, token by token: a token routed otherwise is
// ambiguous when the golden's margin is within what precision p can move it, the routing was not
// replayed, and the candidate's choice is a top-k choice of the golden's selection scores moved
// by at most that much (a margin of exactly 0 is a tie, which the tie rule decides); anything
// else is a wrong expert.
struct RoutingJudgement {
  TensorResult ids;
  std::vector<AmbiguousToken> ambiguous;
  std::set<std::int64_t> rows;  // the ambiguous tokens
};
RoutingJudgement judge_routing(const safetensors::File& golden, const safetensors::File& candidate,
                               const RoutedCase& rc, bool f32, Precision p);

// The candidate tensor c with the rows of `rows` (its first dimension is the token) replaced by
// the golden's values, in `dtype`: what is judged of a tensor ambiguous tokens contaminate row by
// row.
safetensors::Tensor without_rows(const safetensors::Tensor& c, const safetensors::Tensor& g,
                                 const std::set<std::int64_t>& rows, safetensors::DType dtype);

// An integer result other than the choice (the grouped layout's offsets and source rows), judged
// exactly: pass when every entry is the golden's, else fail naming the first that is not. I32 or
// I64 candidates are read.
TensorResult judge_exact_ints(const safetensors::Tensor& g, const safetensors::Tensor* c);

// "3, 7, 12" (the first 8, then "...").
std::string tokens_str(const std::set<std::int64_t>& rows);

}  // namespace teo::golden::detail
