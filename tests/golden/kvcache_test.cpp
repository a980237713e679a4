// The serving ops (docs/semantics.md, "KV caches and split-KV"): a paged cache gives a contiguous
// cache's bits for any page size and block table; a sequence run through attention_kvcache chunk
// by chunk gets the rows of one causal attention pass; attention_merge of any split of the keys
// is the unsplit attention, and an empty split changes nothing.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <rapidcheck.h>
#include <rapidcheck/gtest.h>
#include <nlohmann/json.hpp>

#include "rc_support.hpp"
#include "support.hpp"
#include "teo/backend.hpp"
#include "teo/golden_ops.hpp"
#include "teo/layers/attention.hpp"
#include "teo/safetensors.hpp"

namespace teo {
namespace {

namespace st = safetensors;
using nlohmann::json;
using Values = std::vector<double>;

golden::OpCase op_case(const char* op, json j) {
  j["op"] = op;
  j["dtype"] = "float64";
  if (!j.contains("seed")) j["seed"] = 5;
  return golden::OpCase::from_json(j);
}

st::Tensor& tensor(st::File& f, const std::string& name) {
  for (auto& t : f.tensors)
    if (t.name == name) return t;
  throw std::runtime_error("no tensor " + name);
}

Values values(const st::File& f, const std::string& name) {
  const auto* t = f.find(name);
  if (!t) throw std::runtime_error("no tensor " + name);
  return t->float_values();
}

void set(st::File& f, const std::string& name, const Values& v) {
  st::Tensor& t = tensor(f, name);
  ASSERT_EQ(t.dtype, st::DType::F64);
  ASSERT_EQ(static_cast<std::int64_t>(v.size()), t.numel()) << name;
  std::memcpy(t.bytes.data(), v.data(), v.size() * sizeof(double));
}

std::size_t at(index_t x) {
  return static_cast<std::size_t>(x);
}

// The attention variant keys a property draws: positions, mask, window, cap, sinks.
json gen_variant(bool causal_only) {
  json j;
  j["causal"] = causal_only || *rc::gen::arbitrary<bool>();
  const int pos = *rc::gen::inRange(0, 3);
  if (pos == 1) {
    j["positional"] = "rope";
    j["rope_style"] = *rc::gen::element(std::string("neox"), std::string("interleaved"));
  }
  if (pos == 2) j["positional"] = "alibi";
  if (*rc::gen::element(false, false, true)) j["sliding_window"] = *rc::gen::inRange(1, 6);
  if (*rc::gen::element(false, false, true)) j["attn_logit_softcap"] = 2.0;
  if (*rc::gen::element(false, false, true)) j["attn_sinks"] = true;
  return j;
}

// ---- paged against contiguous ---------------------------------------------------------------

// The same step on a contiguous cache and on a paged one holding the same tokens behind a random
// block table (any page size, pages in any order, spare pages, unused entries): the context and
// lse are the same bits on every backend, the appended tokens land at the same places, and every
// page slot the step does not write keeps its bytes.
RC_GTEST_PROP(KvCache, PagedEqualsContiguousBitForBit, ()) {
  const auto keep = test::gen_backend();
  const index_t hkv = *rc::gen::inRange<index_t>(1, 3);
  const index_t h = hkv * *rc::gen::inRange<index_t>(1, 4);
  const index_t b = *rc::gen::inRange<index_t>(1, 4), sq = *rc::gen::inRange<index_t>(1, 5);
  const index_t dh = 2 * *rc::gen::inRange<index_t>(1, 4);
  const index_t dv = *rc::gen::element(dh, index_t{1}, index_t{5});
  const auto ps = *rc::gen::oneOf(rc::gen::inRange<index_t>(1, 9),
                                  rc::gen::element<index_t>(16, 128, 256, 512));
  std::vector<std::int64_t> cache;
  index_t longest = 0;
  for (index_t i = 0; i < b; ++i) {
    cache.push_back(*rc::gen::inRange<std::int64_t>(0, 41));
    longest = std::max(longest, cache.back() + sq);
  }
  json base = gen_variant(false);
  base.update({{"batch", b},
               {"num_heads", h},
               {"num_kv_heads", hkv},
               {"q_len", sq},
               {"d_head", dh},
               {"d_head_v", dv},
               {"cache_lengths", cache}});
  // the contiguous cache is as long as the longest sequence (read in place) or longer (gathered)
  json cj = base;
  cj["max_len"] = longest + *rc::gen::element<index_t>(0, 0, 3);
  const index_t max_len = cj["max_len"];
  // the block table: pages of a random permutation, spare pages, unused entries anywhere
  std::vector<index_t> used;
  index_t total = 0, most = 0;
  for (auto c : cache) {
    used.push_back((c + sq + ps - 1) / ps);
    total += used.back();
    most = std::max(most, used.back());
  }
  const index_t pages = total + *rc::gen::inRange<index_t>(0, 3);
  const index_t width = most + *rc::gen::inRange<index_t>(0, 2);
  std::vector<index_t> order(at(pages));
  std::iota(order.begin(), order.end(), index_t{0});
  std::mt19937_64 shuffle(*rc::gen::arbitrary<std::uint32_t>());
  std::shuffle(order.begin(), order.end(), shuffle);
  json table = json::array();
  std::size_t next = 0;
  for (index_t i = 0; i < b; ++i) {
    json row = json::array();
    for (index_t p = 0; p < width; ++p)
      row.push_back(p < used[at(i)] ? order[next++] : order[at(pages - 1 - p % pages)]);
    table.push_back(row);
  }
  json pj = base;
  pj.update({{"layout", "paged"}, {"page_size", ps}, {"num_pages", pages}, {"block_table", table}});
  st::File fc = golden::make_op(op_case("attention_kvcache", cj));
  st::File fp = golden::make_op(op_case("attention_kvcache", pj));
  // the paged cache holds the contiguous cache's tokens
  const auto slot = [&](index_t i, index_t g, index_t t, index_t d) {
    const index_t page = table[at(i)][at(t / ps)].get<index_t>();
    return at(((page * ps + t % ps) * hkv + g) * d);
  };
  const auto row = [&](index_t i, index_t g, index_t t, index_t d) {
    return at(((i * hkv + g) * max_len + t) * d);
  };
  for (const auto& [name, d] : {std::pair{std::string("k"), dh}, {std::string("v"), dv}}) {
    const Values kc = values(fc, "input." + name + "_cache");
    Values kp = values(fp, "input." + name + "_pages");
    for (index_t i = 0; i < b; ++i)
      for (index_t g = 0; g < hkv; ++g)
        for (index_t t = 0; t < cache[at(i)]; ++t)
          std::copy_n(kc.begin() + static_cast<std::ptrdiff_t>(row(i, g, t, d)), d,
                      kp.begin() + static_cast<std::ptrdiff_t>(slot(i, g, t, d)));
    set(fp, "input." + name + "_pages", kp);
  }
  const auto rc_ = golden::run_op(fc), rp = golden::run_op(fp);
  RC_ASSERT(rc_.at("output.context") == rp.at("output.context"));
  RC_ASSERT(rc_.at("output.lse") == rp.at("output.lse"));
  for (const auto& [name, d] : {std::pair{std::string("k"), dh}, {std::string("v"), dv}}) {
    const Values& oc = rc_.at("output." + name + "_cache");
    const Values& op = rp.at("output." + name + "_pages");
    Values untouched = values(fp, "input." + name + "_pages");
    for (index_t i = 0; i < b; ++i)
      for (index_t g = 0; g < hkv; ++g)
        for (index_t t = 0; t < cache[at(i)] + sq; ++t)
          for (index_t e = 0; e < d; ++e) {
            RC_ASSERT(op[slot(i, g, t, d) + at(e)] == oc[row(i, g, t, d) + at(e)]);
            untouched[slot(i, g, t, d) + at(e)] = op[slot(i, g, t, d) + at(e)];
          }
    RC_ASSERT(op == untouched);
  }
}

// ---- chunked prefill -----------------------------------------------------------------------

// A sequence split into chunks of any sizes and run through attention_kvcache chunk after chunk,
// each chunk's keys appended to the cache the last one returned: each chunk's context and lse
// are the rows that one bottom-right causal attention over the whole sequence gives, bitwise on
// simd, to rounding on reference and blas (whose sums over the keys follow the key count).
RC_GTEST_PROP(KvCache, ChunkedPrefillEqualsOnePass, ()) {
  const auto keep = test::gen_backend();
  const index_t hkv = *rc::gen::inRange<index_t>(1, 3);
  const index_t h = hkv * *rc::gen::inRange<index_t>(1, 3);
  const index_t b = *rc::gen::inRange<index_t>(1, 3), s = *rc::gen::inRange<index_t>(1, 13);
  const index_t dh = 2 * *rc::gen::inRange<index_t>(1, 4);
  const index_t dv = *rc::gen::element(dh, index_t{3});
  const json variant = gen_variant(true);
  json fj = variant;
  fj.update({{"batch", b},
             {"num_heads", h},
             {"num_kv_heads", hkv},
             {"seq_len", s},
             {"d_head", dh},
             {"lse", true},
             {"probs", false}});
  if (dv != dh) {
    fj.erase("seq_len");
    fj.update({{"q_len", s}, {"kv_len", s}, {"d_head_v", dv}});
  }
  const st::File full = golden::make_op(op_case("attention", fj));
  const auto one = golden::run_op(full);
  const Values q = values(full, "input.q"), k = values(full, "input.k"),
               v = values(full, "input.v");
  const index_t max_len = s + *rc::gen::element<index_t>(0, 2);
  Values k_cache, v_cache;
  const bool bitwise = backend() == Backend::simd;
  for (index_t a = 0; a < s;) {
    const index_t c = std::min(s - a, *rc::gen::inRange<index_t>(1, 5));
    json kj = variant;
    kj.update({{"batch", b},
               {"num_heads", h},
               {"num_kv_heads", hkv},
               {"q_len", c},
               {"d_head", dh},
               {"d_head_v", dv},
               {"max_len", max_len},
               {"cache_lengths", std::vector<std::int64_t>(at(b), a)}});
    st::File f = golden::make_op(op_case("attention_kvcache", kj));
    // rows [a, a + c) of q (B, H, S, Dh), k (B, Hkv, S, Dh), v (B, Hkv, S, Dv)
    const auto rows = [&](const Values& x, index_t heads, index_t d) {
      Values out;
      for (index_t bh = 0; bh < b * heads; ++bh)
        for (index_t i = a; i < a + c; ++i)
          for (index_t e = 0; e < d; ++e) out.push_back(x[at((bh * s + i) * d + e)]);
      return out;
    };
    set(f, "input.q", rows(q, h, dh));
    set(f, "input.k_new", rows(k, hkv, dh));
    set(f, "input.v_new", rows(v, hkv, dv));
    if (variant.contains("attn_sinks")) set(f, "param.sinks", values(full, "param.sinks"));
    if (a > 0) {
      set(f, "input.k_cache", k_cache);
      set(f, "input.v_cache", v_cache);
    }
    const auto r = golden::run_op(f);
    for (index_t bh = 0; bh < b * h; ++bh)
      for (index_t i = 0; i < c; ++i) {
        const double l1 = one.at("output.lse")[at(bh * s + a + i)];
        const double l2 = r.at("output.lse")[at(bh * c + i)];
        RC_ASSERT(l1 == l2 || (!bitwise && std::abs(l1 - l2) <= 1e-12 * (1 + std::abs(l1))));
        for (index_t e = 0; e < dv; ++e) {
          const double x = one.at("output.context")[at((bh * s + a + i) * dv + e)];
          const double y = r.at("output.context")[at((bh * c + i) * dv + e)];
          RC_ASSERT(x == y || (!bitwise && std::abs(x - y) <= 1e-12));
        }
      }
    k_cache = r.at("output.k_cache");
    v_cache = r.at("output.v_cache");
    a += c;
  }
}

// ---- merging split-KV parts ----------------------------------------------------------------

struct Parts {
  std::vector<Values> context, lse;
  std::vector<Values> k, v;  // each part's keys and values (B, Hkv, its keys, D)
};

// The non-causal attention of one part over its keys kp, vp (its kv_lengths part_len).
AttentionArgs<double> part_args(index_t b, index_t h, index_t hkv, index_t sq, index_t dh,
                                index_t dv, index_t keys, const std::vector<std::int64_t>& q_len,
                                const std::vector<std::int64_t>& part_len,
                                std::optional<double> cap) {
  AttentionArgs<double> a{.batch = b, .heads = h, .seq_len = sq, .d_head = dh};
  a.lengths = q_len.data();
  a.kv_len = keys;
  a.kv_lengths = part_len.data();
  a.d_head_v = dv;
  a.variant.kv_heads = hkv;
  a.variant.softcap = cap;
  return a;
}

std::vector<std::int64_t> share(const std::vector<std::int64_t>& kv_len, index_t lo, index_t hi) {
  std::vector<std::int64_t> out;
  for (auto l : kv_len) out.push_back(std::clamp<std::int64_t>(l - lo, 0, hi - lo));
  return out;
}

// Non-causal attention of q over keys [lo, hi) of k and v (with each sequence's kv_lengths):
// its context (B, H, Sq, Dv) and lse (B, H, Sq); an empty range gives -inf and 0.
void attend(Parts& out, const Values& q, const Values& k, const Values& v, index_t b, index_t h,
            index_t hkv, index_t sq, index_t skv, index_t dh, index_t dv,
            const std::vector<std::int64_t>& kv_len, index_t lo, index_t hi,
            std::optional<double> cap) {
  Values ctx(at(b * h * sq * dv), 0.0), lse(at(b * h * sq), -INFINITY);
  Values kp, vp;
  for (index_t bg = 0; bg < b * hkv; ++bg)
    for (index_t j = lo; j < hi; ++j) {
      for (index_t e = 0; e < dh; ++e) kp.push_back(k[at((bg * skv + j) * dh + e)]);
      for (index_t e = 0; e < dv; ++e) vp.push_back(v[at((bg * skv + j) * dv + e)]);
    }
  if (hi > lo) {
    const std::vector<std::int64_t> q_len(at(b), sq), part_len = share(kv_len, lo, hi);
    attention_forward_rows(
        part_args(b, h, hkv, sq, dh, dv, hi - lo, q_len, part_len, cap),
        {.context = ctx.data(), .lse = lse.data(), .q = q.data(), .k = kp.data(), .v = vp.data()});
  }
  out.k.push_back(std::move(kp));
  out.v.push_back(std::move(vp));
  out.context.push_back(std::move(ctx));
  out.lse.push_back(std::move(lse));
}

// Merges the parts through the attention_merge op (its upstream gradients from `grads`, when
// given): every output and gradient by name.
std::map<std::string, Values> merge(const Parts& p, index_t b, index_t h, index_t sq, index_t dv,
                                    const std::map<std::string, Values>* grads = nullptr) {
  const auto n = static_cast<index_t>(p.context.size());
  st::File f = golden::make_op(
      op_case("attention_merge",
              {{"num_parts", n}, {"batch", b}, {"num_heads", h}, {"q_len", sq}, {"d_head_v", dv}}));
  Values c, l;
  for (index_t i = 0; i < n; ++i) {
    c.insert(c.end(), p.context[at(i)].begin(), p.context[at(i)].end());
    l.insert(l.end(), p.lse[at(i)].begin(), p.lse[at(i)].end());
  }
  set(f, "input.context_parts", c);
  set(f, "input.lse_parts", l);
  if (grads) {
    for (const auto& [name, g] : *grads) set(f, name, g);
  }
  auto r = golden::run_op(f);
  for (const char* u : {"grad.output.context", "grad.output.lse"}) r[u] = values(f, u);
  return r;
}

// Keys cut into parts at random points (parts may be empty, and a sequence's padding may leave a
// part with nothing for its rows): merging the parts' contexts through their lse gives the
// unsplit attention to rounding; inserting an empty part anywhere changes no bit of the result
// nor of the other parts' gradients.
RC_GTEST_PROP(KvCache, MergeOfAnySplitIsTheUnsplitAttention, ()) {
  const auto keep = test::gen_backend();
  const index_t hkv = *rc::gen::inRange<index_t>(1, 3);
  const index_t h = hkv * *rc::gen::inRange<index_t>(1, 3);
  const index_t b = *rc::gen::inRange<index_t>(1, 3), sq = *rc::gen::inRange<index_t>(1, 4);
  const index_t skv = *rc::gen::inRange<index_t>(1, 17), dh = *rc::gen::inRange<index_t>(1, 6);
  const index_t dv = *rc::gen::inRange<index_t>(1, 6);
  std::vector<std::int64_t> kv_len;
  for (index_t i = 0; i < b; ++i) kv_len.push_back(*rc::gen::inRange<std::int64_t>(0, skv + 1));
  const std::optional<double> cap =
      *rc::gen::arbitrary<bool>() ? std::optional<double>(3.0) : std::nullopt;
  const auto seed = *rc::gen::arbitrary<std::uint32_t>();
  const Values q = test::uniform_vector<double>(b * h * sq * dh, seed, "q");
  const Values k = test::uniform_vector<double>(b * hkv * skv * dh, seed, "k");
  const Values v = test::uniform_vector<double>(b * hkv * skv * dv, seed, "v");
  Parts whole, split;
  attend(whole, q, k, v, b, h, hkv, sq, skv, dh, dv, kv_len, 0, skv, cap);
  auto cuts = *rc::gen::container<std::vector<index_t>>(*rc::gen::inRange<std::size_t>(0, 4),
                                                        rc::gen::inRange<index_t>(0, skv + 1));
  cuts.push_back(0);
  cuts.push_back(skv);
  std::sort(cuts.begin(), cuts.end());
  for (std::size_t i = 0; i + 1 < cuts.size(); ++i)
    attend(split, q, k, v, b, h, hkv, sq, skv, dh, dv, kv_len, cuts[i], cuts[i + 1], cap);
  const auto m = merge(split, b, h, sq, dv);
  for (std::size_t i = 0; i < whole.lse[0].size(); ++i) {
    const double want = whole.lse[0][i], got = m.at("output.lse")[i];
    if (std::isinf(want))
      RC_ASSERT(got == want);
    else
      RC_ASSERT(std::abs(got - want) <= 1e-13 * (1 + std::abs(want)));
  }
  for (std::size_t i = 0; i < whole.context[0].size(); ++i)
    RC_ASSERT(std::abs(m.at("output.context")[i] - whole.context[0][i]) <= 1e-13);
  // an empty part, inserted anywhere
  const auto where = *rc::gen::inRange<std::size_t>(0, split.context.size() + 1);
  Parts more = split;
  more.context.insert(more.context.begin() + static_cast<std::ptrdiff_t>(where),
                      Values(whole.context[0].size(), 0.0));
  more.lse.insert(more.lse.begin() + static_cast<std::ptrdiff_t>(where),
                  Values(whole.lse[0].size(), -INFINITY));
  const std::map<std::string, Values> grads = {{"grad.output.context", m.at("grad.output.context")},
                                               {"grad.output.lse", m.at("grad.output.lse")}};
  const auto m2 = merge(more, b, h, sq, dv, &grads);
  RC_ASSERT(m2.at("output.context") == m.at("output.context"));
  RC_ASSERT(m2.at("output.lse") == m.at("output.lse"));
  for (const auto& [name, per] :
       {std::pair{std::string("grad.input.context_parts"), whole.context[0].size()},
        {std::string("grad.input.lse_parts"), whole.lse[0].size()}}) {
    const Values& g1 = m.at(name);
    Values g2 = m2.at(name);
    const auto first = g2.begin() + static_cast<std::ptrdiff_t>(where * per);
    RC_ASSERT(std::all_of(first, first + static_cast<std::ptrdiff_t>(per),
                          [](double x) { return x == 0.0; }));
    g2.erase(first, first + static_cast<std::ptrdiff_t>(per));
    RC_ASSERT(g2 == g1);
  }
}

// The backward of split-KV in pieces: the merge's backward gives each part the upstream gradients
// of its context and its lse, and each part's attention backward (through its lse) then gives its
// share of dq, and its keys' and values' dk and dv. Summed over the parts, dq is the unsplit
// attention's, and each part's dk and dv are the unsplit ones' rows of its keys (to rounding).
RC_GTEST_PROP(KvCache, SplitKvBackwardInPiecesIsTheUnsplitBackward, ()) {
  const auto keep = test::gen_backend();
  const index_t hkv = *rc::gen::inRange<index_t>(1, 3);
  const index_t h = hkv * *rc::gen::inRange<index_t>(1, 3);
  const index_t b = *rc::gen::inRange<index_t>(1, 3), sq = *rc::gen::inRange<index_t>(1, 4);
  const index_t skv = *rc::gen::inRange<index_t>(2, 13), dh = *rc::gen::inRange<index_t>(1, 5);
  const index_t dv = *rc::gen::inRange<index_t>(1, 5);
  std::vector<std::int64_t> kv_len;
  for (index_t i = 0; i < b; ++i) kv_len.push_back(*rc::gen::inRange<std::int64_t>(0, skv + 1));
  const std::optional<double> cap =
      *rc::gen::arbitrary<bool>() ? std::optional<double>(3.0) : std::nullopt;
  const auto seed = *rc::gen::arbitrary<std::uint32_t>();
  const Values q = test::uniform_vector<double>(b * h * sq * dh, seed, "q");
  const Values k = test::uniform_vector<double>(b * hkv * skv * dh, seed, "k");
  const Values v = test::uniform_vector<double>(b * hkv * skv * dv, seed, "v");
  const Values dctx = test::uniform_vector<double>(b * h * sq * dv, seed, "dcontext");
  const std::vector<std::int64_t> q_len(at(b), sq);
  // the unsplit backward
  Values dq(q.size(), 0.0), dk(k.size(), 0.0), dvv(v.size(), 0.0);
  attention_backward_rows(part_args(b, h, hkv, sq, dh, dv, skv, q_len, kv_len, cap),
                          {.dq = dq.data(),
                           .dk = dk.data(),
                           .dv = dvv.data(),
                           .dcontext = dctx.data(),
                           .q = q.data(),
                           .k = k.data(),
                           .v = v.data()});
  // the parts, merged, and their backward from the merge's gradients
  const index_t cut = *rc::gen::inRange<index_t>(1, skv);
  Parts parts;
  attend(parts, q, k, v, b, h, hkv, sq, skv, dh, dv, kv_len, 0, cut, cap);
  attend(parts, q, k, v, b, h, hkv, sq, skv, dh, dv, kv_len, cut, skv, cap);
  const std::map<std::string, Values> up = {{"grad.output.context", dctx},
                                            {"grad.output.lse", Values(at(b * h * sq), 0.0)}};
  const auto m = merge(parts, b, h, sq, dv, &up);
  const Values& dc = m.at("grad.input.context_parts");
  const Values& dl = m.at("grad.input.lse_parts");
  Values dq_sum(q.size(), 0.0);
  for (index_t p = 0; p < 2; ++p) {
    const index_t lo = p == 0 ? 0 : cut, hi = p == 0 ? cut : skv;
    const auto part_len = share(kv_len, lo, hi);
    Values dqp(q.size(), 0.0), dkp(parts.k[at(p)].size(), 0.0), dvp(parts.v[at(p)].size(), 0.0);
    attention_backward_rows(part_args(b, h, hkv, sq, dh, dv, hi - lo, q_len, part_len, cap),
                            {.dq = dqp.data(),
                             .dk = dkp.data(),
                             .dv = dvp.data(),
                             .dcontext = dc.data() + p * b * h * sq * dv,
                             .q = q.data(),
                             .k = parts.k[at(p)].data(),
                             .v = parts.v[at(p)].data(),
                             .dlse = dl.data() + p * b * h * sq});
    for (std::size_t i = 0; i < dq.size(); ++i) dq_sum[i] += dqp[i];
    for (index_t bg = 0; bg < b * hkv; ++bg)
      for (index_t j = lo; j < hi; ++j) {
        for (index_t e = 0; e < dh; ++e)
          RC_ASSERT(std::abs(dkp[at((bg * (hi - lo) + j - lo) * dh + e)] -
                             dk[at((bg * skv + j) * dh + e)]) <= 1e-12);
        for (index_t e = 0; e < dv; ++e)
          RC_ASSERT(std::abs(dvp[at((bg * (hi - lo) + j - lo) * dv + e)] -
                             dvv[at((bg * skv + j) * dv + e)]) <= 1e-12);
      }
  }
  for (std::size_t i = 0; i < dq.size(); ++i) RC_ASSERT(std::abs(dq_sum[i] - dq[i]) <= 1e-12);
}

}  // namespace
}  // namespace teo
