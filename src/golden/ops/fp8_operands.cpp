// An fp8 op case's quantized operands (docs/golden-format.md, "fp8 operands"): which the case can
// store, their validation, and their values, as the case's emulated fp8 run quantizes them.
#include <cmath>
#include <stdexcept>

#include "golden/ops/op.hpp"
#include "kernels/fp8_product.hpp"
#include "teo/fp8.hpp"
#include "teo/rounding.hpp"

namespace teo::golden::ops {

using safetensors::File;

namespace {

DType fp8_dtype(Fp8Format f) {
  return f == Fp8Format::e4m3 ? DType::F8_E4M3 : DType::F8_E5M2;
}

std::int64_t blocks(index_t n, index_t block) {
  return (n + block - 1) / block;
}

}  // namespace

std::vector<detail::ExpectedTensor> fp8_operand_tensors(const OpCase& c, const Spec& s) {
  std::vector<detail::ExpectedTensor> out;
  if (c.precision != Precision::fp8 || !s.def->fp8_operands) return out;
  for (const Fp8OperandSlot& o : s.def->fp8_operands(s)) {
    const Fp8Quantization how = fp8_quantization(c.fp8, o.gradient, o.weight);
    const Fp8Block b = fp8_block(how, o.rows, o.k);
    const std::string name = std::string("fp8.") + o.name;
    out.push_back({name, fp8_dtype(how.format), {o.rows, o.k}, "(rows, k)", true});
    out.push_back({name + ".scale",
                   DType::F32,
                   {blocks(o.rows, b.rows), blocks(o.k, b.k)},
                   "(ceil(rows / block_rows), ceil(k / block_k))",
                   true});
  }
  return out;
}

void check_fp8_operands(const File& f, const std::vector<detail::ExpectedTensor>& operands) {
  for (std::size_t i = 0; i + 1 < operands.size(); i += 2) {
    const std::string& values = operands[i].name;
    const std::string& scale = operands[i + 1].name;
    const auto* q = f.find(values);
    const auto* d = f.find(scale);
    if (!q != !d) {
      throw FormatError("the op case holds " + (q ? values : scale) + " without " +
                        (q ? scale : values));
    }
    if (!d) continue;
    const auto v = d->values<float>();
    for (std::size_t k = 0; k < v.size(); ++k) {
      if (!(std::isfinite(v[k]) && v[k] > 0)) {
        throw FormatError("the op case's " + scale + "[" + std::to_string(k) + "] is " +
                          std::to_string(v[k]) + "; an fp8 scale is finite and positive");
      }
    }
  }
}

void add_fp8_operands(File& f, const std::vector<detail::ExpectedTensor>& operands,
                      const std::vector<bool>& wanted) {
  const teo::detail::Fp8Recorder recorder;
  run_op(f, Precision::fp8);
  for (std::size_t i = 0; i + 1 < operands.size(); i += 2) {
    if (!wanted[i]) continue;
    const auto& values = operands[i];
    const std::string name = values.name.substr(4);  // without "fp8."
    const teo::detail::Fp8Recorder::Operand* rec = nullptr;
    for (const auto& r : recorder.operands()) {
      if (r.name == name) {
        rec = &r;
        break;
      }
    }
    // a product with nothing to multiply (a size 0) quantizes nothing
    if (!rec) continue;
    const Fp8Operand& o = rec->value;
    const auto& scale = operands[i + 1];
    const Fp8Format fmt = values.dtype == DType::F8_E4M3 ? Fp8Format::e4m3 : Fp8Format::e5m2;
    if (std::vector<std::int64_t>{o.rows, o.k} != values.shape || o.format != fmt ||
        static_cast<std::int64_t>(o.scale.size()) != scale.shape[0] * scale.shape[1]) {
      throw std::logic_error("the op's fp8 operand " + name +
                             " is not of the shape and format its OpDef::fp8_operands gives");
    }
    std::vector<std::uint8_t> bytes(o.q.size());
    // the values are fp8 already: the conversion is exact
    to_fp8_bits(fmt, false, bytes.data(), o.q.data(), static_cast<index_t>(o.q.size()));
    f.add(values.name, values.dtype, values.shape, bytes.data(), bytes.size());
    f.add<float>(scale.name, scale.shape, o.scale.data(), o.scale.size());
  }
}

}  // namespace teo::golden::ops
