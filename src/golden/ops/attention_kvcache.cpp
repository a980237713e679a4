// The attention_kvcache op (docs/golden-format.md, "Op cases"): one serving step. The new tokens'
// keys and values are appended to a contiguous or paged KV cache at each sequence's cache length,
// RoPE rotates the new queries and keys at those positions, and the queries attend to everything
// cached so far, bottom-right causal. Forward only.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <numeric>
#include <string>
#include <vector>

#include "golden/ops/op.hpp"
#include "golden/ops/quantize_case.hpp"
#include "golden/ops/rotary.hpp"
#include "model/model_internal.hpp"
#include "teo/fp8.hpp"
#include "teo/layers/attention.hpp"
#include "teo/rng.hpp"

namespace teo::golden::ops {

namespace {

// The op's spec: batch sequences of q_len new tokens, num_heads query heads (num_kv_heads key and
// value heads) of d_head (values d_head_v), the scale, whether the lse is an output, the attention
// variants of the config; and the cache: each sequence's cached tokens, contiguous (max_len rows
// per sequence) or paged (num_pages pages of page_size rows, and the block table (batch,
// max_pages), row by row). kv_seq is the most keys any sequence attends to.
struct KvCacheSpec {
  index_t batch = 0, heads = 0, seq = 0, d_head = 0, d_head_v = 0, kv_heads = 0, kv_seq = 0;
  std::optional<double> scale;
  bool lse = true;
  struct Cache {
    std::vector<std::int64_t> cache_lengths;
    bool paged = false;
    index_t page_size = 0, num_pages = 0, max_pages = 0;
    std::string page_order;  // in_order, reversed or shuffled; empty: the spec gives the table
    std::vector<std::int64_t> block_table;
  } kv;
  index_t max_len = 0;  // the rows of a sequence's cache (paged: max_pages * page_size)
  ModelConfig cfg;
  // The cache's format: the case's float type, fp8 (E4M3 or E5M2) with a scale per tensor or per
  // KV head, or int8 with a scale per token and KV head (docs/golden-format.md, "Quantized KV
  // caches").
  enum class Format { none, fp8, int8 } format = Format::none;
  Fp8Format fp8 = Fp8Format::e4m3;
  bool per_head = false;
};

const KvCacheSpec& own(const Spec& s) {
  return s.as<KvCacheSpec>();
}

index_t pages_for(index_t tokens, index_t page_size) {
  return (tokens + page_size - 1) / page_size;
}

// The pages each sequence uses once the step's tokens are appended.
std::vector<index_t> pages_used(const KvCacheSpec& s) {
  std::vector<index_t> used;
  used.reserve(s.kv.cache_lengths.size());
  for (auto c : s.kv.cache_lengths) used.push_back(pages_for(c + s.seq, s.kv.page_size));
  return used;
}

// An explicit block table: B rows of max_pages entries in [0, num_pages) (num_pages: the given
// one, else the largest entry + 1); each sequence's used entries are pages no other entry in use
// names.
void parse_block_table(KvCacheSpec& s, Reader& r, const json& t) {
  auto& kv = s.kv;
  if (!t.is_array() || static_cast<index_t>(t.size()) != s.batch) {
    throw ShapeError("spec.block_table must be an array of batch = " + std::to_string(s.batch) +
                     " rows");
  }
  kv.max_pages = -1;
  std::int64_t top = -1;
  for (const auto& row : t) {
    if (!row.is_array() || row.empty() ||
        (kv.max_pages >= 0 && static_cast<index_t>(row.size()) != kv.max_pages)) {
      throw ShapeError("spec.block_table's rows must be non-empty arrays of one length");
    }
    kv.max_pages = static_cast<index_t>(row.size());
    for (const auto& e : row) {
      if (!e.is_number_integer() || e.get<std::int64_t>() < 0 ||
          e.get<std::int64_t>() >= (std::int64_t{1} << 31) - 1) {
        throw ConfigError("spec.block_table must hold page indices in [0, 2^31 - 1), got " +
                          e.dump());
      }
      kv.block_table.push_back(e.get<std::int64_t>());
      top = std::max(top, e.get<std::int64_t>());
    }
  }
  if (kv.max_pages < 0) kv.max_pages = 1;  // no sequences
  kv.num_pages = r.has("num_pages") ? r.size("num_pages", 1) : std::max<index_t>(top + 1, 1);
  if (top >= kv.num_pages) {
    throw ShapeError("spec.block_table names page " + std::to_string(top) +
                     ", beyond num_pages = " + std::to_string(kv.num_pages));
  }
}

// The block table of a page order: sequence by sequence, its used entries take the next pages of
// the order (0, 1, ... in order; num_pages - 1, ... reversed; a fixed permutation of the pages,
// shuffled), and its unused entries page 0.
void order_block_table(KvCacheSpec& s) {
  auto& kv = s.kv;
  std::vector<index_t> order(static_cast<std::size_t>(kv.num_pages));
  std::iota(order.begin(), order.end(), index_t{0});
  if (kv.page_order == "reversed") std::reverse(order.begin(), order.end());
  if (kv.page_order == "shuffled") {
    // Fisher-Yates from the end, drawn from the generator's stream "block_table" at seed 0: the
    // table is the spec's, whatever the case's seed
    for (std::size_t i = order.size(); i > 1; --i) {
      const double u = rng::uniform01(0, rng::stream_id("block_table"), i);
      const auto j = std::min(i - 1, static_cast<std::size_t>(u * static_cast<double>(i)));
      std::swap(order[i - 1], order[j]);
    }
  }
  kv.block_table.assign(static_cast<std::size_t>(s.batch * kv.max_pages), 0);
  std::size_t next = 0;
  const auto used = pages_used(s);
  for (index_t b = 0; b < s.batch; ++b)
    for (index_t p = 0; p < used[static_cast<std::size_t>(b)]; ++p)
      kv.block_table[static_cast<std::size_t>(b * kv.max_pages + p)] = order[next++];
}

void parse(Spec& spec, Reader& r) {
  auto& s = spec.own.emplace<KvCacheSpec>();
  s.cfg = r.op_config();
  auto& kv = s.kv;
  s.batch = r.size("batch", 0);
  s.heads = r.size("num_heads", 1);
  s.seq = r.size("q_len", 1);
  s.d_head = r.size("d_head", 1);
  s.d_head_v = r.has("d_head_v") ? r.size("d_head_v", 1) : s.d_head;
  s.kv_heads = r.has("num_kv_heads") ? r.size("num_kv_heads", 1) : s.heads;
  if (s.heads % s.kv_heads != 0) {
    throw ConfigError("spec.num_kv_heads must divide num_heads = " + std::to_string(s.heads) +
                      ", got " + std::to_string(s.kv_heads));
  }
  s.scale = r.number("scale");
  kv.paged = r.choice("layout", {"contiguous", "paged"}, "contiguous") == "paged";
  for (const char* k : kv.paged ? std::vector<const char*>{"max_len"}
                                : std::vector<const char*>{"page_size", "num_pages", "max_pages",
                                                           "page_order", "block_table"}) {
    if (r.has(k)) {
      throw ConfigError(std::string("spec.") + k + " goes with layout \"" +
                        (kv.paged ? "contiguous" : "paged") + "\"");
    }
  }
  if (!r.has("cache_lengths")) r.missing("cache_lengths");
  std::optional<std::pair<index_t, index_t>> unused;
  if (!kv.paged) {
    s.max_len = r.size("max_len", s.seq);
    kv.cache_lengths = r.prefix_lengths("cache_lengths", s.batch, kMaxDim - s.seq, unused);
    for (std::size_t b = 0; b < kv.cache_lengths.size(); ++b) {
      if (kv.cache_lengths[b] + s.seq > s.max_len) {
        throw ShapeError("spec.cache_lengths: sequence " + std::to_string(b) + " has " +
                         std::to_string(kv.cache_lengths[b]) +
                         " cached tokens and q_len = " + std::to_string(s.seq) +
                         " new ones, beyond max_len = " + std::to_string(s.max_len));
      }
    }
  } else {
    kv.page_size = r.size("page_size", 1);
    kv.cache_lengths = r.prefix_lengths("cache_lengths", s.batch, kMaxDim - s.seq, unused);
    const auto used = pages_used(s);
    const index_t most = used.empty() ? 1 : *std::max_element(used.begin(), used.end());
    if (r.has("block_table")) {
      if (r.has("page_order") || r.has("max_pages")) {
        throw ConfigError(
            "spec.block_table gives the table: page_order and max_pages go without one");
      }
      r.use("block_table");
      parse_block_table(s, r, r.value("block_table"));
    } else {
      kv.page_order = r.choice("page_order", {"shuffled", "in_order", "reversed"}, "shuffled");
      kv.max_pages = r.has("max_pages") ? r.size("max_pages", 1) : std::max<index_t>(most, 1);
      index_t total = 0;
      for (auto u : used) total += u;
      kv.num_pages = r.has("num_pages") ? r.size("num_pages", 1) : std::max<index_t>(total, 1);
      if (total > kv.num_pages) {
        throw ShapeError("spec.num_pages = " + std::to_string(kv.num_pages) +
                         " is fewer than the " + std::to_string(total) + " pages in use");
      }
    }
    for (index_t b = 0; b < s.batch; ++b) {
      const auto i = static_cast<std::size_t>(b);
      if (used[i] > kv.max_pages) {
        throw ShapeError("spec: sequence " + std::to_string(b) + " needs " +
                         std::to_string(used[i]) + " pages for its " +
                         std::to_string(kv.cache_lengths[i] + s.seq) +
                         " tokens, and its block table row has " + std::to_string(kv.max_pages));
      }
    }
    if (!kv.block_table.empty()) {
      // the used entries of an explicit table: distinct pages
      std::map<std::int64_t, index_t> owner;  // by page: the spec is not yet accepted by size
      for (index_t b = 0; b < s.batch; ++b) {
        for (index_t p = 0; p < used[static_cast<std::size_t>(b)]; ++p) {
          const auto page = kv.block_table[static_cast<std::size_t>(b * kv.max_pages + p)];
          const auto [it, fresh] = owner.emplace(page, b);
          if (!fresh) {
            throw ConfigError("spec.block_table gives page " + std::to_string(page) +
                              " to two entries in use (sequences " + std::to_string(it->second) +
                              " and " + std::to_string(b) + ")");
          }
        }
      }
    }
    s.max_len = checked_mul(kv.max_pages, kv.page_size, "the paged cache's capacity");
  }
  // the keys: each sequence's cached tokens and the new ones
  s.kv_seq = 0;  // no sequences: no keys
  for (auto c : kv.cache_lengths) s.kv_seq = std::max(s.kv_seq, c + s.seq);
  attention_positions(s.cfg, s.d_head, s.kv_seq, "attention_kvcache");
  if (s.cfg.embeddings.positional == Positional::rope &&
      s.cfg.attention.rope_scaling.type == RopeScalingType::ntk) {
    throw ConfigError(
        "spec.rope_scaling \"ntk\" (dynamic) is not defined for a KV cache step: its base "
        "follows the sequence's end");
  }
  s.lse = r.flag("lse", true);
  const std::string f =
      r.choice("cache_format", {"float", "fp8_e4m3", "fp8_e5m2", "int8"}, "float");
  s.format = f == "float"  ? KvCacheSpec::Format::none
             : f == "int8" ? KvCacheSpec::Format::int8
                           : KvCacheSpec::Format::fp8;
  s.fp8 = f == "fp8_e5m2" ? Fp8Format::e5m2 : Fp8Format::e4m3;
  if (r.has("kv_scale") && s.format != KvCacheSpec::Format::fp8)
    throw ConfigError("spec.kv_scale applies to an fp8 cache_format (int8 has one per token)");
  s.per_head = r.choice("kv_scale", {"per_tensor", "per_head"}, "per_tensor") == "per_head";
  if (s.format != KvCacheSpec::Format::none && s.cfg.embeddings.positional == Positional::rope) {
    throw ConfigError(
        "spec.cache_format: a quantized cache's append is judged exactly, so the keys it "
        "quantizes are inputs: give them rotated (positional \"none\"), not RoPE");
  }
}

// A quantized cache is the case's own quantization: no fp8 recipe on top of it.
void check_case(const Spec& spec, const OpCase& c) {
  if (own(spec).format != KvCacheSpec::Format::none && c.precision == Precision::fp8)
    throw ConfigError("spec.precision fp8: the cache of a cache_format case is quantized already");
}

void fill(Spec& spec) {
  auto& s = spec.as<KvCacheSpec>();
  if (s.kv.paged && s.kv.block_table.empty()) order_block_table(s);
}

const std::vector<std::int64_t>* given_ints(const Spec& spec, const std::string& name) {
  const auto& s = own(spec);
  if (name == "input.cache_lengths") return &s.kv.cache_lengths;
  if (name == "input.block_table") return &s.kv.block_table;
  return nullptr;
}

void write_sizes(const Spec& spec, ojson& j) {
  const auto& s = own(spec);
  const auto& kv = s.kv;
  j["batch"] = s.batch;
  j["num_heads"] = s.heads;
  j["q_len"] = s.seq;
  j["d_head"] = s.d_head;
  if (s.d_head_v != s.d_head) j["d_head_v"] = s.d_head_v;
  if (s.kv_heads != s.heads) j["num_kv_heads"] = s.kv_heads;
  j["layout"] = kv.paged ? "paged" : "contiguous";
  if (kv.paged) {
    j["page_size"] = kv.page_size;
    j["num_pages"] = kv.num_pages;
  } else {
    j["max_len"] = s.max_len;
  }
  j["cache_lengths"] = kv.cache_lengths;
}

void write_options(const Spec& spec, ojson& j) {
  const auto& s = own(spec);
  const auto& kv = s.kv;
  if (kv.paged && !kv.page_order.empty()) {
    j["max_pages"] = kv.max_pages;
    j["page_order"] = kv.page_order;
  } else if (kv.paged) {
    ojson t = ojson::array();
    for (index_t b = 0; b < s.batch; ++b) {
      const auto* row = kv.block_table.data() + b * kv.max_pages;
      t.push_back(std::vector<std::int64_t>(row, row + kv.max_pages));
    }
    j["block_table"] = t;
  }
  j["scale"] = s.scale ? *s.scale : 1.0 / std::sqrt(static_cast<double>(s.d_head));
  j["lse"] = s.lse;
  if (s.format == KvCacheSpec::Format::none) return;
  j["cache_format"] = s.format == KvCacheSpec::Format::int8 ? "int8"
                      : s.fp8 == Fp8Format::e4m3            ? "fp8_e4m3"
                                                            : "fp8_e5m2";
  if (s.format == KvCacheSpec::Format::fp8) j["kv_scale"] = s.per_head ? "per_head" : "per_tensor";
}

// The cache's shape for a head size d: (B, Hkv, max_len, d) or (num_pages, page_size, Hkv, d).
Dims cache_dims(const KvCacheSpec& s, index_t d) {
  if (s.kv.paged) return {s.kv.num_pages, s.kv.page_size, s.kv_heads, d};
  return {s.batch, s.kv_heads, s.max_len, d};
}

// A quantized cache's scales: (1) or (Hkv) for fp8, one per cache row and head for int8 (the
// cache's dims without the last).
Dims scale_dims(const KvCacheSpec& s) {
  if (s.format == KvCacheSpec::Format::fp8) return {s.per_head ? s.kv_heads : 1};
  Dims d = cache_dims(s, 1);
  d.pop_back();
  return d;
}

DType code_dtype(const KvCacheSpec& s) {
  if (s.format == KvCacheSpec::Format::int8) return DType::I8;
  return s.fp8 == Fp8Format::e4m3 ? DType::F8_E4M3 : DType::F8_E5M2;
}

// A quantized cache's tensor, stored as a serving engine stores it (an output: judged exactly).
Slot packed_slot(std::string name, DType d, Dims dims, Role role) {
  Slot x{std::move(name), d, std::move(dims), role};
  x.packed = true;
  x.exact = x.no_grad = role == Role::output;
  return x;
}

void tensors(const Spec& spec, OpTensors& t) {
  const auto& s = own(spec);
  const bool paged = s.kv.paged;
  const bool quantized = s.format != KvCacheSpec::Format::none;
  const Dims q = {s.batch, s.heads, s.seq, s.d_head};
  t.in.push_back(float_slot("input.q", q, Role::input));
  t.in.push_back(float_slot("input.k_new", {s.batch, s.kv_heads, s.seq, s.d_head}, Role::input));
  t.in.push_back(float_slot("input.v_new", {s.batch, s.kv_heads, s.seq, s.d_head_v}, Role::input));
  const std::string k = paged ? "k_pages" : "k_cache", v = paged ? "v_pages" : "v_cache";
  if (quantized) {
    t.fixed.push_back(
        packed_slot("input." + k, code_dtype(s), cache_dims(s, s.d_head), Role::input));
    t.fixed.push_back(
        packed_slot("input." + v, code_dtype(s), cache_dims(s, s.d_head_v), Role::input));
    for (const char* n : {"input.k_scale", "input.v_scale"})
      t.fixed.push_back(packed_slot(n, DType::F32, scale_dims(s), Role::input));
  } else {
    t.in.push_back(float_slot("input." + k, cache_dims(s, s.d_head), Role::input));
    t.in.push_back(float_slot("input." + v, cache_dims(s, s.d_head_v), Role::input));
  }
  t.fixed.push_back({"input.cache_lengths", DType::I64, {s.batch}, Role::input});
  if (paged) {
    t.fixed.push_back({"input.block_table", DType::I32, {s.batch, s.kv.max_pages}, Role::input});
  }
  if (s.cfg.attention.attn_sinks) t.in.push_back(float_slot("param.sinks", {s.heads}, Role::param));
  // In pipeline order: the rotated queries, the append, then the attention.
  if (s.cfg.embeddings.positional == Positional::rope) {
    t.out.push_back(float_slot("output.q_rot", q, Role::output));
    t.out.back().optional = true;
  }
  if (quantized) {
    // int8's scales first: a wrong scale is the first divergence, not the codes it spoils
    if (s.format == KvCacheSpec::Format::int8) {
      for (const char* n : {"output.k_scale", "output.v_scale"})
        t.out.push_back(packed_slot(n, DType::F32, scale_dims(s), Role::output));
    }
    t.out.push_back(
        packed_slot("output." + k, code_dtype(s), cache_dims(s, s.d_head), Role::output));
    t.out.push_back(
        packed_slot("output." + v, code_dtype(s), cache_dims(s, s.d_head_v), Role::output));
  } else {
    t.out.push_back(float_slot("output." + k, cache_dims(s, s.d_head), Role::output));
    t.out.push_back(float_slot("output." + v, cache_dims(s, s.d_head_v), Role::output));
  }
  if (s.lse) {
    t.out.push_back(float_slot("output.lse", {s.batch, s.heads, s.seq}, Role::output));
    t.out.back().optional = true;
  }
  t.out.push_back(
      float_slot("output.context", {s.batch, s.heads, s.seq, s.d_head_v}, Role::output));
}

index_t longest_reduction(const Spec& spec) {
  const auto& s = own(spec);
  return std::max({s.kv_seq, s.d_head, s.d_head_v});
}

// The attention reads a contiguous cache in place when every sequence fills it; otherwise it
// gathers each sequence's keys, leaving out the rows past them, which it must never read (they
// may hold anything, NaN included).
bool in_place(const KvCacheSpec& s) {
  if (s.kv.paged) return false;
  for (auto c : s.kv.cache_lengths)
    if (c + s.seq != s.max_len) return false;
  return true;
}

double working_bytes(const Spec& spec) {
  const auto& s = own(spec);
  // the keys and values gathered per sequence (unless the contiguous cache is read in place),
  // the rotated new keys, and RoPE's table of cos and sin
  const auto d = [](index_t x) { return static_cast<double>(x); };
  const double kv =
      in_place(s) ? 0.0 : d(s.batch) * d(s.kv_heads) * d(s.kv_seq) * d(s.d_head + s.d_head_v);
  const double table =
      s.cfg.embeddings.positional == Positional::rope ? d(s.kv_seq) * d(s.cfg.rotary()) : 0;
  return 8 * (kv + d(s.batch) * d(s.kv_heads) * d(s.seq) * d(s.d_head) + table);
}

// Where row t of sequence b, K/V head g, sits in a cache of head size d.
struct CacheIndex {
  const KvCacheSpec& s;
  const std::int64_t* table;
  index_t operator()(index_t b, index_t g, index_t t, index_t d) const {
    const auto& kv = s.kv;
    if (!kv.paged) return ((b * s.kv_heads + g) * s.max_len + t) * d;
    const index_t page = table[b * kv.max_pages + t / kv.page_size];
    return ((page * kv.page_size + t % kv.page_size) * s.kv_heads + g) * d;
  }
};

// ---- a quantized cache (docs/golden-format.md, "Quantized KV caches") ------------------------

// The largest code's magnitude: the fp8 format's largest value, or int8's 127.
double fp8_or_int8_max(const KvCacheSpec& s) {
  return s.format == KvCacheSpec::Format::fp8 ? static_cast<double>(fp8_max(s.fp8)) : 127.0;
}

// The other code of x under scale sc at a near tie (quantize_case.hpp), for this cache's format:
// around the exact quotient, against the code the case's own arithmetic gives.
double other_rounding(const KvCacheSpec& s, double x, float sc, bool f32) {
  if (s.format == KvCacheSpec::Format::fp8)
    return other_fp8_rounding(s.fp8, x / sc, fp8_code(s.fp8, x, sc, f32));
  return other_int8_rounding(x / sc, int8_code(x, sc, f32));
}

// The K/V head of element i of a cache of head size d.
index_t head_of(const KvCacheSpec& s, index_t i, index_t d) {
  return s.kv.paged ? (i / d) % s.kv_heads : (i / (s.max_len * d)) % s.kv_heads;
}

// A quantized cache's scales, each finite and positive (int8's: or 0, a row of zeros);
// FormatError naming the first that is not.
std::vector<double> scales_of(const Values& v, const std::string& n, bool int8) {
  auto x = packed_numbers(v, n, DType::F32);
  for (std::size_t i = 0; i < x.size(); ++i) {
    if (!std::isfinite(x[i]) || x[i] < 0 || (!int8 && x[i] == 0)) {
      throw FormatError("the op case's " + n + "[" + std::to_string(i) + "] is " +
                        std::to_string(x[i]) + "; a KV cache scale is finite and positive" +
                        (int8 ? " (or 0 for a row of zeros)" : "") + ", never a default");
    }
  }
  return x;
}

// The cached tokens of a quantized cache, as a serving engine wrote them: drawn uniform in
// [-1, 1) as a float cache is, then quantized by the append's own rule. fp8's scales are
// amax / fp8_max times 2^u (u uniform in [0, 1), from the scale's stream), amax over the cache and
// the new tokens (of the head, per_head), so that nothing saturates; int8's, each row's own.
void draw(const Spec& spec, const OpCase& c, Values& v) {
  const auto& s = own(spec);
  if (s.format == KvCacheSpec::Format::none) return;
  const bool f32 = c.dtype == "float32";
  for (const bool key : {true, false}) {
    const std::string name =
        std::string("input.") + (key ? "k_" : "v_") + (s.kv.paged ? "pages" : "cache");
    const std::string scale = key ? "input.k_scale" : "input.v_scale";
    const index_t d = key ? s.d_head : s.d_head_v;
    const std::int64_t n = numel(cache_dims(s, d));
    std::vector<double> x(static_cast<std::size_t>(n));
    const std::uint64_t stream = rng::stream_id(name);
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = 2 * rng::uniform01(c.seed, stream, i) - 1;
    as_stored(x, c);
    std::vector<unsigned char> codes(x.size());
    std::vector<float> sc;
    if (s.format == KvCacheSpec::Format::fp8) {
      std::vector<double> amax(s.per_head ? static_cast<std::size_t>(s.kv_heads) : 1, 0.0);
      const auto slot = [&](index_t g) -> double& { return amax[s.per_head ? g : 0]; };
      for (index_t i = 0; i < n; ++i)
        slot(head_of(s, i, d)) = std::max(slot(head_of(s, i, d)), std::abs(x[i]));
      const auto& fresh = v.f.at(key ? "input.k_new" : "input.v_new");
      for (std::size_t j = 0; j < fresh.size(); ++j) {
        const index_t g = (static_cast<index_t>(j) / (s.seq * d)) % s.kv_heads;
        slot(g) = std::max(slot(g), std::abs(fresh[j]));
      }
      for (std::size_t g = 0; g < amax.size(); ++g) {
        const double u = rng::uniform01(c.seed, rng::stream_id(scale), g);
        sc.push_back(amax[g] > 0 ? static_cast<float>(amax[g] / fp8_max(s.fp8) * std::exp2(u))
                                 : 1.0f);
      }
      for (index_t i = 0; i < n; ++i) {
        const float q =
            static_cast<float>(fp8_code(s.fp8, x[i], sc[s.per_head ? head_of(s, i, d) : 0], f32));
        codes[i] = to_fp8_bits(s.fp8, false, q);
      }
    } else {
      for (index_t r = 0; r < n / d; ++r) {
        sc.push_back(int8_scale(x.data() + r * d, d, f32));
        for (index_t j = 0; j < d; ++j) {
          const auto q = static_cast<std::int8_t>(int8_code(x[r * d + j], sc.back(), f32));
          codes[r * d + j] = static_cast<unsigned char>(q);
        }
      }
    }
    v.raw[name] = std::move(codes);
    auto& b = v.raw[scale];
    b.resize(sc.size() * 4);
    std::memcpy(b.data(), sc.data(), b.size());
  }
}

// The appended codes' other roundings at near ties (OpDef::alternates): the quotients of the new
// keys or values over their scales, recomputed in float64 from the case's inputs.
std::vector<double> alternates(const Spec& spec, const Values& v, const std::string& name) {
  const auto& s = own(spec);
  const std::string kind = s.kv.paged ? "pages" : "cache";
  const bool key = name == "output.k_" + kind;
  if (s.format == KvCacheSpec::Format::none || (!key && name != "output.v_" + kind)) return {};
  const index_t d = key ? s.d_head : s.d_head_v;
  const auto& fresh = v.f.at(key ? "input.k_new" : "input.v_new");
  const auto& cache = spec_ints_of(v, spec, "input.cache_lengths");
  const CacheIndex at{s, s.kv.paged ? spec_ints_of(v, spec, "input.block_table").data() : nullptr};
  const bool int8 = s.format == KvCacheSpec::Format::int8, f32 = spec.float32;
  const auto given =
      int8 ? std::vector<double>() : scales_of(v, key ? "input.k_scale" : "input.v_scale", false);
  std::vector<double> out(static_cast<std::size_t>(numel(cache_dims(s, d))), NAN);
  for (index_t b = 0; b < s.batch; ++b)
    for (index_t g = 0; g < s.kv_heads; ++g)
      for (index_t i = 0; i < s.seq; ++i) {
        const index_t t = cache[static_cast<std::size_t>(b)] + i;
        const double* x = fresh.data() + ((b * s.kv_heads + g) * s.seq + i) * d;
        const double sc = int8 ? int8_scale(x, d, f32) : given[s.per_head ? g : 0];
        if (!(sc > 0)) continue;
        for (index_t j = 0; j < d; ++j)
          out[static_cast<std::size_t>(at(b, g, t, d) + j)] =
              other_rounding(s, x[j], static_cast<float>(sc), f32);
      }
  return out;
}

template <class Real>
void run(RunContext<Real>& c) {
  const auto& s = own(c.s);
  auto& r = c.r;
  const bool paged = s.kv.paged;
  const std::string k_in = paged ? "input.k_pages" : "input.k_cache";
  const std::string v_in = paged ? "input.v_pages" : "input.v_cache";
  const std::string k_out = paged ? "output.k_pages" : "output.k_cache";
  const std::string v_out = paged ? "output.v_pages" : "output.v_cache";
  const auto q = c.in("input.q"), k_new = c.in("input.k_new"), v_new = c.in("input.v_new");
  const auto& cache = spec_ints_of(c.v, c.s, "input.cache_lengths");
  const CacheIndex at{s, paged ? spec_ints_of(c.v, c.s, "input.block_table").data() : nullptr};
  const index_t B = s.batch, Hkv = s.kv_heads, Sq = s.seq, Dh = s.d_head, Dv = s.d_head_v;
  // RoPE: new token i of sequence b at position cache_lengths[b] + i
  const bool rope = s.cfg.embeddings.positional == Positional::rope;
  Tensor<Real> k_rot;
  if (rope) {
    const Rotary<Real> rot(s.cfg, std::vector<index_t>(cache.begin(), cache.end()), s.kv_seq);
    rot.apply(r.at("output.q_rot").data(), q.data(), s.heads, Sq, Dh, /*back=*/false);
    c.done("output.q_rot");
    k_rot = c.zeros("input.k_new");
    rot.apply(k_rot.data(), k_new.data(), Hkv, Sq, Dh, /*back=*/false);
  }
  // The append: new token i of sequence b is row cache_lengths[b] + i of its cache (a quantized
  // cache's row: its codes, and int8's scale).
  const bool quantized = s.format != KvCacheSpec::Format::none;
  const bool int8 = s.format == KvCacheSpec::Format::int8, f32 = c.s.float32;
  std::vector<double> scale[2];
  if (quantized) {
    const auto as_tensor = [&](const std::string& in, const std::string& out, DType d) {
      const auto x = packed_numbers(c.v, in, d);
      auto& t = r.at(out);
      for (index_t i = 0; i < t.numel(); ++i) {
        // a code the append never writes: an fp8 NaN or infinity, int8's -128
        if (!std::isfinite(x[i]) || x[i] < -fp8_or_int8_max(s) || x[i] > fp8_or_int8_max(s)) {
          throw FormatError("the op case's " + in + "[" + std::to_string(i) + "] is " +
                            std::to_string(x[i]) + ", not a code of the " +
                            (int8 ? "int8" : "fp8") + " cache (finite, within +-" +
                            std::to_string(static_cast<int>(fp8_or_int8_max(s))) + ")");
        }
        t[i] = static_cast<Real>(x[i]);
      }
    };
    as_tensor(k_in, k_out, code_dtype(s));
    as_tensor(v_in, v_out, code_dtype(s));
    scale[0] = scales_of(c.v, "input.k_scale", int8);
    scale[1] = scales_of(c.v, "input.v_scale", int8);
  } else {
    r.at(k_out) = c.in(k_in);
    r.at(v_out) = c.in(v_in);
  }
  Real* kc = r.at(k_out).data();
  Real* vc = r.at(v_out).data();
  const Real* kn = rope ? k_rot.data() : k_new.data();
  // row x (d values) of a new token into its cache slot `to`; int8: its scale into `row`
  const auto put = [&](const Real* x, index_t d, Real* to, int side, index_t g, index_t row) {
    if (!quantized) return void(std::copy_n(x, d, to));
    if (!int8) {
      const auto sc = static_cast<float>(scale[side][s.per_head ? g : 0]);
      for (index_t j = 0; j < d; ++j) to[j] = static_cast<Real>(fp8_code(s.fp8, x[j], sc, f32));
      return;
    }
    const float sc = int8_scale(x, d, f32);
    scale[side][static_cast<std::size_t>(row)] = sc;
    for (index_t j = 0; j < d; ++j) to[j] = static_cast<Real>(int8_code(x[j], sc, f32));
  };
  for (index_t b = 0; b < B; ++b)
    for (index_t g = 0; g < Hkv; ++g)
      for (index_t i = 0; i < Sq; ++i) {
        const index_t t = cache[static_cast<std::size_t>(b)] + i, n = (b * Hkv + g) * Sq + i;
        put(kn + n * Dh, Dh, kc + at(b, g, t, Dh), 0, g, at(b, g, t, 1));
        put(v_new.data() + n * Dv, Dv, vc + at(b, g, t, Dv), 1, g, at(b, g, t, 1));
      }
  Tensor<Real> kd, vd;  // a quantized cache dequantized: what the attention reads
  if (quantized) {
    const auto dequantize = [&](const Tensor<Real>& codes, index_t d, int side, Tensor<Real>& to,
                                const std::string& what) {
      to = Tensor<Real>(codes.shape());
      for (index_t i = 0; i < codes.numel(); ++i) {
        const double sc = scale[side][static_cast<std::size_t>(int8         ? i / d
                                                               : s.per_head ? head_of(s, i, d)
                                                                            : 0)];
        to[i] = static_cast<Real>(static_cast<double>(codes[i]) * sc);
      }
      store(to, c.p, what);
    };
    dequantize(r.at(k_out), Dh, 0, kd, "the dequantized keys");
    dequantize(r.at(v_out), Dv, 1, vd, "the dequantized values");
    if (int8) {
      for (int side = 0; side < 2; ++side) {
        auto& t = r.at(side == 0 ? "output.k_scale" : "output.v_scale");
        for (index_t i = 0; i < t.numel(); ++i) t[i] = static_cast<Real>(scale[side][i]);
      }
    }
    kc = kd.data();
    vc = vd.data();
  } else {
    c.done(k_out);
    c.done(v_out);
  }
  // The attention reads each sequence's first cache_lengths[b] + Sq rows: in place from a
  // contiguous cache they all fill, else gathered into (B, Hkv, L, D), zero past them.
  const index_t L = s.kv_seq;
  std::vector<std::int64_t> q_len(static_cast<std::size_t>(B), Sq), kv_len;
  kv_len.reserve(static_cast<std::size_t>(B));
  for (auto x : cache) kv_len.push_back(x + Sq);
  Tensor<Real> kg, vg;
  const Real *keys = kc, *values = vc;
  if (!in_place(s)) {
    kg = Tensor<Real>({B, Hkv, L, Dh});
    vg = Tensor<Real>({B, Hkv, L, Dv});
    for (index_t b = 0; b < B; ++b)
      for (index_t g = 0; g < Hkv; ++g)
        for (index_t t = 0; t < kv_len[static_cast<std::size_t>(b)]; ++t) {
          const index_t n = (b * Hkv + g) * L + t;
          std::copy_n(kc + at(b, g, t, Dh), Dh, kg.data() + n * Dh);
          std::copy_n(vc + at(b, g, t, Dv), Dv, vg.data() + n * Dv);
        }
    keys = kg.data();
    values = vg.data();
  }
  const Tensor<Real> sinks = s.cfg.attention.attn_sinks ? c.in("param.sinks") : Tensor<Real>();
  AttentionArgs<Real> args = teo::detail::attention_args(s.cfg, B, Sq, q_len.data(), sinks.data(),
                                                         static_cast<Real*>(nullptr));
  args.heads = s.heads;
  args.d_head = Dh;
  args.d_head_v = Dv;
  args.scale = s.scale;
  args.variant.kv_heads = Hkv;
  args.kv_len = L;
  args.kv_lengths = kv_len.data();
  args.causal_align = CausalAlign::bottom_right;
  attention_forward_rows(args, {.context = r.at("output.context").data(),
                                .lse = s.lse ? r.at("output.lse").data() : nullptr,
                                .q = rope ? r.at("output.q_rot").data() : q.data(),
                                .k = keys,
                                .v = values});
  if (s.lse) c.done("output.lse");
  c.done("output.context");
}

}  // namespace

const OpDef& attention_kvcache_op() {
  static const OpDef def{
      .name = "attention_kvcache",
      .config_keys = attention_config_keys(),
      .base_config = attention_base_config(/*causal=*/true),
      .parse = parse,
      .fill = fill,
      .write_sizes = write_sizes,
      .write_options = write_options,
      .config_of = config_in<KvCacheSpec>,
      .spec_ints = given_ints,
      .tensors = tensors,
      .check_case = check_case,
      .alternates = alternates,
      .longest_reduction = longest_reduction,
      .working_bytes = working_bytes,
      .draw = draw,
      .run_float = run<float>,
      .run_double = run<double>,
      .forward_only = true,
      .has_attention = true,
      .samples =
          {R"({"batch": 2, "num_heads": 2, "q_len": 2, "d_head": 3, "max_len": 6, "cache_lengths": [4, 1]})",
           R"({"batch": 3, "num_heads": 4, "num_kv_heads": 2, "q_len": 3, "d_head": 4, "d_head_v": 3, "layout": "paged", "page_size": 2, "cache_lengths": [0, 5, 2], "positional": "rope", "attn_sinks": true, "sliding_window": 4, "attn_logit_softcap": 2.0})",
           R"({"batch": 2, "num_heads": 2, "q_len": 1, "d_head": 2, "layout": "paged", "page_size": 3, "num_pages": 5, "block_table": [[4, 0], [2, 2]], "cache_lengths": [3, 0], "positional": "alibi", "causal": false, "lse": false})",
           R"({"batch": 2, "num_heads": 4, "num_kv_heads": 2, "q_len": 2, "d_head": 4, "layout": "paged", "page_size": 2, "cache_lengths": [3, 0], "cache_format": "fp8_e4m3", "kv_scale": "per_head"})",
           R"({"batch": 2, "num_heads": 2, "q_len": 1, "d_head": 3, "d_head_v": 2, "max_len": 5, "cache_lengths": [4, 2], "cache_format": "int8"})"},
  };
  return def;
}

}  // namespace teo::golden::ops
