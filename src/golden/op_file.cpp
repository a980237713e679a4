// Writing an op case (teo/golden_ops.hpp, make_op and write_op): the drawn inputs first, then each
// run's results as soon as they are computed, into a File in memory or a file written as it goes.
#include <unistd.h>

#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "golden/ops/op.hpp"
#include "golden/sink.hpp"
#include "golden_internal.hpp"
#include "teo/files.hpp"
#include "teo/fp8.hpp"
#include "teo/golden.hpp"
#include "teo/golden_ops.hpp"

namespace teo::golden {

namespace ops {
namespace {

using detail::Metadata;
using detail::out_of;
using detail::Sink;
using safetensors::DType;
using safetensors::File;

// The header of a case: its drawn tensors and its results in layout order, then a float32 case's
// ref64.* twins of its float results (an integer result, exact in either run, has none).
std::vector<safetensors::Entry> entries_of(const std::vector<Slot>& slots, bool f32) {
  const auto stored = [&](DType d) { return d == DType::F64 && f32 ? DType::F32 : d; };
  std::vector<safetensors::Entry> e;
  for (const auto& t : slots)
    if (!is_result(t.role)) e.push_back({t.name, stored(t.dtype), t.shape});
  for (const auto& t : slots)
    if (is_result(t.role)) e.push_back({t.name, stored(t.dtype), t.shape});
  if (f32) {
    for (const auto& t : slots)
      if (has_ref64(t)) e.push_back({"ref64." + t.name, DType::F64, t.shape});
  }
  return e;
}

// A packed result's values (exactly representable in `d`) as the bytes of d.
template <class Real>
std::vector<unsigned char> packed_bytes(DType d, const Tensor<Real>& x) {
  const auto n = static_cast<std::size_t>(x.numel());
  std::vector<unsigned char> b(n * safetensors::dtype_size(d));
  for (std::size_t i = 0; i < n; ++i) {
    if (d == DType::F32) {
      const auto f = static_cast<float>(x[static_cast<index_t>(i)]);
      std::memcpy(b.data() + 4 * i, &f, 4);
    } else if (d == DType::I8) {
      b[i] = static_cast<unsigned char>(static_cast<std::int8_t>(x[static_cast<index_t>(i)]));
    } else if (d == DType::F8_E4M3 || d == DType::F8_E5M2) {
      b[i] = to_fp8_bits(d == DType::F8_E4M3 ? Fp8Format::e4m3 : Fp8Format::e5m2, false,
                         static_cast<float>(x[static_cast<index_t>(i)]));
    } else {
      throw std::logic_error("a packed result of another dtype");
    }
  }
  return b;
}

// Puts a run's results under their names (prefix before each) and frees each once it is put.
template <class Real>
void put_results(Sink& sink, const std::vector<Slot>& slots, Results<Real>& r,
                 const std::string& prefix) {
  for (const auto& t : slots) {
    if (!is_result(t.role)) continue;
    const auto it = r.find(t.name);
    const Tensor<Real>& x = it->second;
    if (t.packed) {
      // in its own dtype (exact values: codes, float32 scales); a float one's ref64 twin in F64
      if (prefix.empty()) {
        const auto bytes = packed_bytes(t.dtype, x);
        sink.put({t.name, t.dtype, t.shape, bytes.data(), bytes.size()});
      } else if (safetensors::is_float(t.dtype)) {
        sink.put(out_of(prefix + t.name, t.shape, x.data(), static_cast<std::size_t>(x.numel())));
      }
    } else if (t.dtype == DType::I32) {
      // integer outputs (exact in Real) have no ref64 twin
      if (prefix.empty()) {
        const std::vector<std::int32_t> ids(x.begin(), x.end());
        sink.put(out_of(t.name, t.shape, ids.data(), ids.size()));
      }
    } else {
      sink.put(out_of(prefix + t.name, t.shape, x.data(), static_cast<std::size_t>(x.numel())));
    }
    r.erase(it);
  }
}

// Generates case c into `sink` and returns its metadata. The last run spends the drawn values.
template <class Real>
Metadata make_into(const OpCase& c, const Spec& s, Sink& sink) {
  constexpr bool f32 = std::is_same_v<Real, float>;
  const auto slots = layout(s);
  Metadata meta = {
      {"format", kOpFormat}, {"op", c.op}, {"spec", c.spec.dump()}, {"teo_version", TEO_VERSION}};
  // the file's errors (an existing file, a missing directory) before anything is drawn
  sink.begin(meta, entries_of(slots, f32));
  Values v = draw_inputs(s, c);
  for (const auto& t : slots) {
    if (is_result(t.role)) continue;
    if (t.packed) {
      const auto& x = v.raw.at(t.name);
      sink.put({t.name, t.dtype, t.shape, x.data(), x.size()});
    } else if (t.dtype == DType::I64) {
      const auto& x = v.i64.at(t.name);
      sink.put(out_of(t.name, t.shape, x.data(), x.size()));
    } else if (t.dtype == DType::I32) {
      const auto& x = v.i64.at(t.name);
      const std::vector<std::int32_t> y(x.begin(), x.end());  // in range: the spec checked it
      sink.put(out_of(t.name, t.shape, y.data(), y.size()));
    } else if (t.dtype == DType::U8) {
      const auto& x = v.u8.at(t.name);
      sink.put(out_of(t.name, t.shape, x.data(), x.size()));
    } else {
      const auto& x = v.f.at(t.name);
      if constexpr (f32) {
        const std::vector<float> y(x.begin(), x.end());
        sink.put(out_of(t.name, t.shape, y.data(), y.size()));
      } else {
        sink.put(out_of(t.name, t.shape, x.data(), x.size()));  // the drawn doubles themselves
      }
    }
  }
  {
    auto r = run<Real>(s, v, c.seed, std::nullopt, {}, nullptr, f32 ? nullptr : &v);
    put_results(sink, slots, r, "");
  }
  if constexpr (f32) {
    auto r64 = run<double>(s, v, c.seed, std::nullopt, {}, nullptr, &v);
    put_results(sink, slots, r64, "ref64.");
  }
  return meta;
}

Metadata make_into(const OpCase& c, const Spec& s, Sink& sink) {
  return c.dtype == "float32" ? make_into<float>(c, s, sink) : make_into<double>(c, s, sink);
}

// Why a float32 case f is ill-conditioned (empty when it is not): its float32 run against
// float64, then a precision case's budgets. IllConditioned unless allowed.
std::string conditioning(const OpCase& c, const File& f, bool allow_ill_conditioned) {
  if (c.dtype != "float32") return "";
  std::string why = detail::float32_conditioning(
      f, detail::longest_reduction(c), [] { return std::string("none found in a single op"); },
      allow_ill_conditioned);
  if (c.precision && why.empty()) {
    try {
      detail::precision_conditioning(f, run_op(f, c.precision), *c.precision, nullptr);
    } catch (const IllConditioned& e) {
      if (!allow_ill_conditioned) throw;
      why = e.what();
    }
  }
  return why;
}

}  // namespace
}  // namespace ops

using namespace ops;  // NOLINT(google-build-using-namespace): this file is the registry's face

safetensors::File make_op(const OpCase& c, bool allow_ill_conditioned, const std::string& keep) {
  // from_json's default limit, with the file held whole (and serialized once)
  constexpr std::uint64_t limit = std::uint64_t{1} << 34;
  if (const std::uint64_t need = c.bytes_needed(/*in_memory=*/true); need > limit) {
    throw ShapeError("the " + c.op + " case needs about " + std::to_string(need >> 20) +
                     " MiB when built in memory, above the limit of " +
                     std::to_string(limit >> 20) + " MiB; `teo golden op` without --keep writes " +
                     "it to its file as it is computed, in about " +
                     std::to_string(c.bytes_needed() >> 20) + " MiB");
  }
  const Spec s = spec_of(c);
  detail::MemorySink sink;
  Metadata meta = make_into(c, s, sink);
  sink.finish(meta);
  File f = sink.take();
  if (const std::string why = conditioning(c, f, allow_ill_conditioned); !why.empty())
    f.metadata.emplace_back("ill_conditioned", why);
  if (keep.empty()) return f;
  // the fp8 operands are chosen with the computed tensors, and computed only when chosen
  const auto operands = fp8_operand_tensors(c, s);
  std::vector<std::string> names;
  for (const auto& t : f.tensors) names.push_back(t.name);
  for (std::size_t i = 0; i < operands.size(); i += 2) names.push_back(operands[i].name);
  const auto stays = kept_names(names, keep, /*op=*/true);
  std::vector<bool> wanted(operands.size(), false);
  bool any = false;
  for (std::size_t i = 0; i < operands.size(); i += 2) {
    wanted[i] = stays[f.tensors.size() + i / 2];
    any = any || wanted[i];
  }
  std::vector<safetensors::Tensor> kept;
  for (std::size_t k = 0; k < f.tensors.size(); ++k)
    if (stays[k]) kept.push_back(std::move(f.tensors[k]));
  f.tensors = std::move(kept);
  f.metadata.emplace_back("kept", keep);
  if (any) add_fp8_operands(f, operands, wanted);
  return f;
}

std::uint64_t write_op(const OpCase& c, const std::string& path, bool overwrite,
                       bool allow_ill_conditioned, const std::string& keep) {
  if (!keep.empty()) {
    // the path's errors before the case is computed
    const auto [fd, tmp] = open_temp_beside(path, overwrite);
    ::close(fd);
    ::unlink(tmp.c_str());
    const std::string bytes = safetensors::serialize(make_op(c, allow_ill_conditioned, keep));
    write_file_atomic(path, bytes, overwrite);
    return bytes.size();
  }
  const Spec s = spec_of(c);
  detail::FileSink sink(path, overwrite);
  Metadata meta = make_into(c, s, sink);
  if (c.dtype == "float32") {
    if (const std::string why = conditioning(c, sink.contents(), allow_ill_conditioned);
        !why.empty())
      meta.emplace_back("ill_conditioned", why);
  }
  sink.finish(meta);
  return sink.size();
}

}  // namespace teo::golden
