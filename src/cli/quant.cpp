// `teo quant`: quantized safetensors checkpoints (teo/quant_formats.hpp) dequantized exactly, or
// float weights quantized by teo, for checking another loader or kernel against teo's values.
#include <algorithm>
#include <ostream>
#include <string>

#include <CLI/CLI.hpp>

#include "cli/commands.hpp"
#include "teo/errors.hpp"
#include "teo/files.hpp"
#include "teo/quant_formats.hpp"
#include "teo/safetensors.hpp"

namespace teo::cli {

namespace {

// Every weight of the format, dequantized to F64 under PREFIX.weight (mxfp4: PREFIX).
int dequantize_checkpoint(const QuantOptions& opts, std::ostream& out) {
  const auto format = quant::parse_tensor_format(opts.format, "--format");
  const safetensors::File in = safetensors::map(opts.in_path);
  const auto packed = quant::find_packed(in, format);
  if (packed.empty()) {
    throw InputError(opts.in_path + ": no " + opts.format + " weight (tensors " +
                     quant::tensor_name(format, "NAME", quant::required_roles(format)[0]) +
                     " and the rest of " + opts.format + "'s)");
  }
  quant::Dequantize how;
  how.zero_offset = opts.zero_offset;
  how.group_size = std::max<index_t>(opts.group_size, 0);
  safetensors::File s;
  for (const auto& [prefix, p] : packed) {
    const std::string what = opts.in_path + ": " + prefix;
    const auto v = quant::dequantize(p, what, how);
    const std::string name = format == quant::TensorFormat::mxfp4 ? prefix : prefix + ".weight";
    s.add(name, quant::dequantized_shape(p, what), v.data(), v.size());
  }
  write_file_atomic(opts.out_path, safetensors::serialize(s), opts.force);
  out << "wrote " << opts.out_path << ": " << packed.size() << " " << opts.format
      << " weights dequantized (F64, exact)\n";
  return 0;
}

// The float tensors of two or more dimensions named *.weight (mxfp4: any) in the format; the rest
// as they are.
int quantize_checkpoint(const QuantOptions& opts, std::ostream& out) {
  const auto format = quant::parse_tensor_format(opts.format, "--format");
  const safetensors::File in = safetensors::map(opts.in_path);
  quant::Quantize how;
  how.group_size = opts.group_size == 0 ? 128 : opts.group_size;
  how.act_order = opts.act_order;
  how.seed = opts.seed;
  how.zero_offset = opts.zero_offset;
  safetensors::File s;
  int count = 0;
  for (const auto& t : in.tensors) {
    const bool mx = format == quant::TensorFormat::mxfp4;
    const bool weight = t.name.ends_with(".weight") || mx;
    if (!safetensors::is_float(t.dtype) || t.shape.size() < 2 || !weight ||
        (!mx && t.shape.size() != 2)) {
      s.add(t.name, t.dtype, t.shape, t.data().data(), t.data().size());
      continue;
    }
    const std::string prefix = mx ? t.name : t.name.substr(0, t.name.size() - 7);
    const auto p = quant::quantize(format, t.float_values(), t.shape, how);
    for (const auto& [role, part] : p.parts) {
      s.add(quant::tensor_name(format, prefix, role), part.dtype, part.shape, part.bytes.data(),
            part.bytes.size());
    }
    ++count;
  }
  write_file_atomic(opts.out_path, safetensors::serialize(s), opts.force);
  out << "wrote " << opts.out_path << ": " << count << " weights in " << opts.format << "\n";
  return 0;
}

}  // namespace

CLI::App* add_quant_commands(CLI::App& app, QuantOptions& opts) {
  CLI::App* q = app.add_subcommand(
      "quant", "Dequantize int8, GPTQ, AWQ, MXFP4 or NVFP4 checkpoints exactly, or quantize");
  q->require_subcommand(1);
  const auto common = [&opts](CLI::App* c) {
    c->add_option("file", opts.in_path, "safetensors file")->required();
    c->add_option("--format", opts.format, "int8, gptq, awq, mxfp4 or nvfp4")->required();
    c->add_option("--out", opts.out_path, "safetensors file to write")->required();
    c->add_option("--zero-offset", opts.zero_offset,
                  "gptq: 1 for v1 checkpoints (\"checkpoint_format\": \"gptq\"), 0 for gptq_v2")
        ->check(CLI::Range(0, 1));
    c->add_flag("--force", opts.force, "overwrite --out");
    c->add_option("--group-size", opts.group_size,
                  "gptq, awq: input columns per group (quantize: default 128, -1 one group; "
                  "dequantize: the checkpoint's group_size, needed where g_idx is absent and the "
                  "columns do not divide evenly)");
  };
  CLI::App* deq = q->add_subcommand(
      "dequantize", "Write every quantized weight's exact values as F64 (PREFIX.weight)");
  common(deq);
  deq->callback([&opts] { opts.command = "dequantize"; });
  CLI::App* qu = q->add_subcommand(
      "quantize",
      "Write the *.weight matrices of a safetensors file in --format (teo's quantizer)");
  common(qu);
  qu->add_flag("--act-order", opts.act_order, "gptq: groups by a seeded permutation (g_idx)");
  qu->add_option("--seed", opts.seed, "gptq --act-order: the permutation's seed");
  qu->callback([&opts] { opts.command = "quantize"; });
  return q;
}

int run_quant(const QuantOptions& opts, std::ostream& out) {
  if (opts.command == "dequantize") return dequantize_checkpoint(opts, out);
  return quantize_checkpoint(opts, out);
}

}  // namespace teo::cli
