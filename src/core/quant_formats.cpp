// The safetensors formats of quantized weights (teo/quant_formats.hpp): names, checks and the exact
// dequantization. Each layout is written out from its reference description (docs/quantization.md
// names the sources); teo's quantizer is in quant_formats_encode.cpp.
#include <cmath>
#include <cstring>
#include <limits>
#include <set>
#include <string>

#include "teo/errors.hpp"
#include "teo/quant.hpp"
#include "teo/quant_formats.hpp"

namespace teo::quant {

namespace {

using safetensors::DType;
using safetensors::Tensor;

constexpr TensorFormat kFormats[] = {TensorFormat::int8, TensorFormat::gptq, TensorFormat::awq,
                                     TensorFormat::mxfp4, TensorFormat::nvfp4};

// AWQ packs the 8 columns of a 32-bit word in the order 0, 2, 4, 6, 1, 3, 5, 7 (AutoAWQ's
// AWQ_ORDER): nibble k holds column kAwqOrder[k].
constexpr int kAwqOrder[8] = {0, 2, 4, 6, 1, 3, 5, 7};

[[noreturn]] void fail(const std::string& what, const std::string& why) {
  throw FormatError(what + ": " + why);
}

std::string shape_str(const std::vector<std::int64_t>& s) {
  std::string out = "[";
  for (std::size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

const Tensor& part(const Packed& p, const std::string& role, const std::string& what) {
  const auto it = p.parts.find(role);
  if (it == p.parts.end()) fail(what, std::string(to_string(p.format)) + " needs its " + role);
  const Tensor& t = it->second;
  std::int64_t n = 1;
  for (const auto d : t.shape) {
    if (d < 0 || (d > 0 && n > (std::int64_t{1} << 40) / d)) {
      fail(what, t.name + " has shape " + shape_str(t.shape) + ", negative or too large");
    }
    n *= d;
  }
  if (t.data().size() != static_cast<std::size_t>(n) * safetensors::dtype_size(t.dtype)) {
    fail(what, t.name + " holds " + std::to_string(t.data().size()) + " bytes, not the " +
                   std::to_string(n) + " elements of its shape");
  }
  return t;
}

void expect_dtype(const Tensor& t, std::initializer_list<DType> ok, const std::string& what) {
  for (DType d : ok)
    if (t.dtype == d) return;
  std::string names;
  for (DType d : ok)
    names += (names.empty() ? "" : " or ") + std::string(safetensors::dtype_name(d));
  fail(what, t.name + " is " + safetensors::dtype_name(t.dtype) + ", expected " + names);
}

void expect_shape(const Tensor& t, const std::vector<std::int64_t>& want, const std::string& what) {
  if (t.shape != want) {
    fail(what, t.name + " has shape " + shape_str(t.shape) + ", expected " + shape_str(want));
  }
}

void expect_rank(const Tensor& t, std::size_t rank, const std::string& what) {
  if (t.shape.size() != rank) {
    fail(what, t.name + " has shape " + shape_str(t.shape) + ", expected " + std::to_string(rank) +
                   " dimensions");
  }
}

// The scales as exact doubles, each finite.
std::vector<double> finite_values(const Tensor& t, const std::string& what) {
  auto v = t.float_values();
  for (std::size_t i = 0; i < v.size(); ++i) {
    if (!std::isfinite(v[i])) {
      fail(what, t.name + " element " + std::to_string(i) + " is " + std::to_string(v[i]) +
                     ", not a finite scale");
    }
  }
  return v;
}

std::vector<std::uint32_t> words(const Tensor& t) {
  std::vector<std::uint32_t> w(t.data().size() / 4);
  if (!w.empty()) std::memcpy(w.data(), t.data().data(), w.size() * 4);
  return w;
}

int nib(std::uint32_t word, int k) {
  return static_cast<int>((word >> (4 * k)) & 0xF);
}

double scalar(const Packed& p, const std::string& role, const std::string& what) {
  const Tensor& t = part(p, role, what);
  expect_dtype(t, {DType::F32}, what);
  if (t.numel() != 1 || t.shape.size() > 1) {
    fail(what, t.name + " has shape " + shape_str(t.shape) + ", expected a scalar ([] or [1])");
  }
  return finite_values(t, what)[0];
}

std::vector<double> dequantize_int8(const Packed& p, const std::string& what) {
  const Tensor& w = part(p, "weight", what);
  const Tensor& s = part(p, "weight_scale", what);
  expect_dtype(w, {DType::I8}, what);
  expect_rank(w, 2, what);
  const index_t rows = w.shape[0], cols = w.shape[1];
  expect_dtype(s, {DType::F32, DType::BF16, DType::F16}, what);
  if (s.shape != std::vector<std::int64_t>{rows} && s.shape != std::vector<std::int64_t>{rows, 1}) {
    fail(what, s.name + " has shape " + shape_str(s.shape) + ", expected [" + std::to_string(rows) +
                   "] or [" + std::to_string(rows) + ", 1] (one scale per output row)");
  }
  const auto scale = finite_values(s, what);
  std::vector<double> out(static_cast<std::size_t>(rows * cols));
  const auto b = w.data();
  for (index_t r = 0; r < rows; ++r)
    for (index_t c = 0; c < cols; ++c) {
      const auto q = static_cast<std::int8_t>(b[static_cast<std::size_t>(r * cols + c)]);
      out[static_cast<std::size_t>(r * cols + c)] = static_cast<double>(q) * scale[r];
    }
  return out;
}

// gptq and awq: the groups of the input columns, from g_idx or contiguous.
std::vector<index_t> column_groups(const Packed& p, index_t cols, index_t groups,
                                   index_t group_size, const std::string& what) {
  std::vector<index_t> g(static_cast<std::size_t>(cols));
  const auto it = p.parts.find("g_idx");
  if (p.format == TensorFormat::gptq && it != p.parts.end()) {
    const Tensor& gi = it->second;
    expect_dtype(gi, {DType::I32, DType::I64}, what);
    expect_shape(gi, {cols}, what);
    const auto v = gi.int_values();
    for (index_t c = 0; c < cols; ++c) {
      if (v[c] < 0 || v[c] >= groups) {
        fail(what, gi.name + "[" + std::to_string(c) + "] is " + std::to_string(v[c]) +
                       ", outside the " + std::to_string(groups) + " groups");
      }
      g[c] = v[c];
    }
    return g;
  }
  // Without g_idx, groups of group_size columns (the last one shorter), as AutoGPTQ and AutoAWQ
  // make them; unknown (0), the columns divided evenly over the scales' groups.
  if (group_size > 0) {
    if ((cols + group_size - 1) / group_size != groups) {
      fail(what, std::to_string(cols) + " input columns in groups of " +
                     std::to_string(group_size) + " are not the scales' " + std::to_string(groups) +
                     " groups");
    }
  } else if (cols % groups != 0) {
    fail(what, std::to_string(cols) + " input columns do not divide into " +
                   std::to_string(groups) + " groups of the scales: give the group size");
  }
  const index_t gs = group_size > 0 ? group_size : cols / groups;
  for (index_t c = 0; c < cols; ++c) g[c] = c / gs;
  return g;
}

std::vector<double> dequantize_int4(const Packed& p, const std::string& what, int zero_offset,
                                    index_t group_size) {
  const bool awq = p.format == TensorFormat::awq;
  const Tensor& qw = part(p, "qweight", what);
  const Tensor& qz = part(p, "qzeros", what);
  const Tensor& sc = part(p, "scales", what);
  for (const Tensor* t : {&qw, &qz}) {
    expect_dtype(*t, {DType::I32}, what);
    expect_rank(*t, 2, what);
  }
  expect_dtype(sc, {DType::F16, DType::BF16, DType::F32}, what);
  expect_rank(sc, 2, what);
  // gptq: qweight (cols / 8, rows); awq: qweight (cols, rows / 8).
  const index_t cols = awq ? qw.shape[0] : 8 * qw.shape[0];
  const index_t rows = awq ? 8 * qw.shape[1] : qw.shape[1];
  const index_t groups = sc.shape[0];
  if (groups < 1) fail(what, sc.name + " has no groups");
  expect_shape(sc, {groups, rows}, what);
  expect_shape(qz, {groups, rows / 8}, what);
  if (rows % 8 != 0) fail(what, std::to_string(rows) + " output rows are not whole words of 8");
  if (!awq && zero_offset != 0 && zero_offset != 1) {
    fail(what, "the GPTQ zero offset is 1 (v1 checkpoints) or 0 (gptq_v2), got " +
                   std::to_string(zero_offset));
  }
  const auto group = column_groups(p, cols, groups, group_size, what);
  const auto s = finite_values(sc, what);
  const auto q = words(qw), z = words(qz);
  const index_t wq = awq ? rows / 8 : rows;  // words per row of qweight
  std::vector<double> out(static_cast<std::size_t>(rows * cols));
  for (index_t r = 0; r < rows; ++r) {
    for (index_t c = 0; c < cols; ++c) {
      const index_t g = group[c];
      const int zr =
          nib(z[g * (rows / 8) + r / 8],
              awq ? awq_nibble_of_column(static_cast<int>(r % 8)) : static_cast<int>(r % 8));
      const int qv = awq ? nib(q[c * wq + r / 8], awq_nibble_of_column(static_cast<int>(r % 8)))
                         : nib(q[(c / 8) * wq + r], static_cast<int>(c % 8));
      if (!awq && zero_offset == 1 && zr == 15) {
        fail(what, qz.name + ": row " + std::to_string(r) + " of group " + std::to_string(g) +
                       " stores a zero of 15, which a v1 checkpoint cannot mean: AutoGPTQ's "
                       "dequantization wraps 15 + 1 to 0, exllama's kernels read 16");
      }
      const int zero = awq ? zr : zr + zero_offset;
      out[static_cast<std::size_t>(r * cols + c)] =
          s[g * rows + r] * static_cast<double>(qv - zero);
    }
  }
  return out;
}

std::vector<double> dequantize_mxfp4(const Packed& p, const std::string& what) {
  const Tensor& bl = part(p, "blocks", what);
  const Tensor& sc = part(p, "scales", what);
  expect_dtype(bl, {DType::U8}, what);
  expect_dtype(sc, {DType::U8}, what);
  if (bl.shape.size() < 3 || bl.shape.back() != 16) {
    fail(what, bl.name + " has shape " + shape_str(bl.shape) +
                   ", expected (..., rows, cols / 32, 16): 16 bytes of 32 E2M1 values a block");
  }
  expect_shape(sc, std::vector<std::int64_t>(bl.shape.begin(), bl.shape.end() - 1), what);
  const auto b = bl.data(), e = sc.data();
  std::vector<double> out(e.size() * 32);
  for (std::size_t k = 0; k < e.size(); ++k) {
    if (e[k] == 0xFF) {
      fail(what, sc.name + " element " + std::to_string(k) + " is 0xff, E8M0's NaN");
    }
    for (int j = 0; j < 32; ++j) {
      const int byte = b[k * 16 + static_cast<std::size_t>(j / 2)];
      const int code = j % 2 ? byte >> 4 : byte & 0xF;
      out[k * 32 + static_cast<std::size_t>(j)] =
          std::ldexp(static_cast<double>(e2m1_value(code)), e[k] - 127);
    }
  }
  return out;
}

std::vector<double> dequantize_nvfp4(const Packed& p, const std::string& what) {
  const Tensor& w = part(p, "weight", what);
  const Tensor& s = part(p, "weight_scale", what);
  expect_dtype(w, {DType::U8}, what);
  expect_rank(w, 2, what);
  const index_t rows = w.shape[0], cols = 2 * w.shape[1];
  if (cols % 16 != 0) fail(what, std::to_string(cols) + " columns are not whole blocks of 16");
  expect_dtype(s, {DType::F8_E4M3}, what);
  expect_shape(s, {rows, cols / 16}, what);
  const auto scale = finite_values(s, what);
  const double global = scalar(p, "weight_scale_2", what);
  if (p.parts.count("input_scale")) scalar(p, "input_scale", what);
  const auto b = w.data();
  std::vector<double> out(static_cast<std::size_t>(rows * cols));
  for (index_t r = 0; r < rows; ++r)
    for (index_t c = 0; c < cols; ++c) {
      const int byte = b[static_cast<std::size_t>(r * (cols / 2) + c / 2)];
      const int code = c % 2 ? byte >> 4 : byte & 0xF;
      out[static_cast<std::size_t>(r * cols + c)] =
          static_cast<double>(e2m1_value(code)) * scale[r * (cols / 16) + c / 16] * global;
    }
  return out;
}

}  // namespace

const char* to_string(TensorFormat f) {
  switch (f) {
    case TensorFormat::int8:
      return "int8";
    case TensorFormat::gptq:
      return "gptq";
    case TensorFormat::awq:
      return "awq";
    case TensorFormat::mxfp4:
      return "mxfp4";
    case TensorFormat::nvfp4:
      return "nvfp4";
  }
  return "?";
}

TensorFormat parse_tensor_format(const std::string& name, const std::string& what) {
  for (TensorFormat f : kFormats)
    if (name == to_string(f)) return f;
  throw ConfigError(what + " must be int8, gptq, awq, mxfp4 or nvfp4, got \"" + name + "\"");
}

int awq_column_at_nibble(int k) {
  return kAwqOrder[k & 7];
}

int awq_nibble_of_column(int j) {
  for (int k = 0; k < 8; ++k)
    if (kAwqOrder[k] == (j & 7)) return k;
  return 0;
}

std::vector<std::string> required_roles(TensorFormat f) {
  switch (f) {
    case TensorFormat::int8:
      return {"weight", "weight_scale"};
    case TensorFormat::gptq:
    case TensorFormat::awq:
      return {"qweight", "qzeros", "scales"};
    case TensorFormat::mxfp4:
      return {"blocks", "scales"};
    case TensorFormat::nvfp4:
      return {"weight", "weight_scale", "weight_scale_2"};
  }
  return {};
}

std::vector<std::string> optional_roles(TensorFormat f) {
  if (f == TensorFormat::gptq) return {"g_idx"};
  if (f == TensorFormat::nvfp4) return {"input_scale"};
  return {};
}

std::string tensor_name(TensorFormat f, const std::string& prefix, const std::string& role) {
  return prefix + (f == TensorFormat::mxfp4 ? "_" : ".") + role;
}

std::map<std::string, Packed> find_packed(const safetensors::File& file, TensorFormat f) {
  std::map<std::string, Packed> out;
  const auto roles = required_roles(f);
  std::vector<std::string> all = roles;
  for (const auto& r : optional_roles(f)) all.push_back(r);
  // Prefixes: names that end in a required role's suffix.
  std::set<std::string> prefixes;
  for (const auto& t : file.tensors) {
    for (const auto& r : roles) {
      const std::string suffix = (f == TensorFormat::mxfp4 ? "_" : ".") + r;
      if (t.name.size() > suffix.size() && t.name.ends_with(suffix))
        prefixes.insert(t.name.substr(0, t.name.size() - suffix.size()));
    }
  }
  for (const auto& prefix : prefixes) {
    if (f == TensorFormat::int8 && file.find(prefix + ".weight_zero_point")) {
      throw FormatError("int8 weight " + prefix +
                        " has a weight_zero_point: asymmetric int8 is not read (teo's int8 is "
                        "symmetric, per output channel)");
    }
    Packed p;
    p.format = f;
    for (const auto& r : all) {
      if (const auto* t = file.find(tensor_name(f, prefix, r))) p.parts[r] = *t;
    }
    // "x.weight" alone is an unquantized weight, not a broken int8 or nvfp4 one.
    if (p.parts.size() == 1 && p.parts.count("weight")) continue;
    for (const auto& r : roles) {
      if (!p.parts.count(r)) {
        throw FormatError(std::string(to_string(f)) + " weight " + prefix + " has no " +
                          tensor_name(f, prefix, r));
      }
    }
    out.emplace(prefix, std::move(p));
  }
  return out;
}

std::vector<std::int64_t> dequantized_shape(const Packed& p, const std::string& what) {
  switch (p.format) {
    case TensorFormat::int8:
      return part(p, "weight", what).shape;
    case TensorFormat::gptq: {
      const auto& s = part(p, "qweight", what).shape;
      return s.size() == 2 ? std::vector<std::int64_t>{s[1], 8 * s[0]} : s;
    }
    case TensorFormat::awq: {
      const auto& s = part(p, "qweight", what).shape;
      return s.size() == 2 ? std::vector<std::int64_t>{8 * s[1], s[0]} : s;
    }
    case TensorFormat::mxfp4: {
      auto s = part(p, "scales", what).shape;
      if (!s.empty()) s.back() *= 32;
      return s;
    }
    case TensorFormat::nvfp4: {
      auto s = part(p, "weight", what).shape;
      if (s.size() == 2) s[1] *= 2;
      return s;
    }
  }
  return {};
}

std::vector<double> dequantize(const Packed& p, const std::string& what, const Dequantize& d) {
  switch (p.format) {
    case TensorFormat::int8:
      return dequantize_int8(p, what);
    case TensorFormat::gptq:
    case TensorFormat::awq:
      return dequantize_int4(p, what, d.zero_offset, d.group_size);
    case TensorFormat::mxfp4:
      return dequantize_mxfp4(p, what);
    case TensorFormat::nvfp4:
      return dequantize_nvfp4(p, what);
  }
  return {};
}

}  // namespace teo::quant
