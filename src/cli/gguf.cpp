// `teo gguf`: GGUF files read, dequantized and written through teo's formats (teo/gguf.hpp,
// teo/quant.hpp), for checking another reader or quantizer against teo's exact values.
#include <cstring>
#include <iomanip>
#include <ostream>
#include <string>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "cli/commands.hpp"
#include "teo/dequant.hpp"
#include "teo/errors.hpp"
#include "teo/files.hpp"
#include "teo/gguf.hpp"
#include "teo/precision.hpp"
#include "teo/safetensors.hpp"

namespace teo::cli {

namespace {

nlohmann::ordered_json value_json(const gguf::Value& v) {
  using gguf::ValueType;
  switch (v.type) {
    case ValueType::u8:
    case ValueType::u16:
    case ValueType::u32:
    case ValueType::u64:
      return v.u;
    case ValueType::i8:
    case ValueType::i16:
    case ValueType::i32:
    case ValueType::i64:
      return v.i;
    case ValueType::f32:
    case ValueType::f64:
      return v.f;
    case ValueType::boolean:
      return v.i != 0;
    case ValueType::string:
      return v.s;
    case ValueType::array: {
      auto a = nlohmann::ordered_json::array();
      for (const auto& item : v.items) a.push_back(value_json(item));
      return a;
    }
  }
  return nullptr;
}

std::string type_str(const gguf::Value& v) {
  if (v.type != gguf::ValueType::array) return gguf::to_string(v.type);
  return std::string("ARRAY of ") + std::to_string(v.items.size()) + " " +
         gguf::to_string(v.item_type);
}

std::string value_text(const gguf::Value& v) {
  if (v.type == gguf::ValueType::array) {
    std::string s = "[";
    for (std::size_t k = 0; k < v.items.size() && k < 4; ++k) {
      s += (k ? ", " : "") + value_text(v.items[k]);
    }
    return s + (v.items.size() > 4 ? ", ...]" : "]");
  }
  if (v.type == gguf::ValueType::string) return nlohmann::json(v.s).dump();
  return value_json(v).dump();
}

int inspect(const GgufOptions& opts, std::ostream& out) {
  const gguf::File f = gguf::map(opts.in_path);
  if (opts.json) {
    nlohmann::ordered_json j;
    j["version"] = f.version;
    j["alignment"] = f.alignment();
    auto meta = nlohmann::ordered_json::array();
    for (const auto& [k, v] : f.metadata) {
      nlohmann::ordered_json e;
      e["key"] = k;
      e["type"] = gguf::to_string(v.type);
      if (v.type == gguf::ValueType::array) e["item_type"] = gguf::to_string(v.item_type);
      e["value"] = value_json(v);
      meta.push_back(std::move(e));
    }
    j["metadata"] = std::move(meta);
    auto tensors = nlohmann::ordered_json::array();
    for (const auto& t : f.tensors) {
      nlohmann::ordered_json e;
      e["name"] = t.name;
      e["type"] = quant::to_string(t.type);
      e["dims"] = t.dims;
      e["bytes"] = t.data().size();
      tensors.push_back(std::move(e));
    }
    j["tensors"] = std::move(tensors);
    out << j.dump(1) << "\n";
    return 0;
  }
  out << opts.in_path << ": GGUF version " << f.version << ", alignment " << f.alignment() << ", "
      << f.metadata.size() << " metadata keys, " << f.tensors.size() << " tensors\n";
  for (const auto& [k, v] : f.metadata)
    out << "  " << k << " (" << type_str(v) << "): " << value_text(v) << "\n";
  for (const auto& t : f.tensors) {
    out << "  " << std::left << std::setw(40) << t.name << " " << std::setw(6)
        << quant::to_string(t.type) << " " << t.shape_str() << ", " << t.data().size()
        << " bytes\n";
  }
  return 0;
}

// Every tensor's exact values as F32, in PyTorch's order of dimensions; __metadata__ gives each
// tensor's ggml type as "gguf.type.NAME".
int dequantize_file(const GgufOptions& opts, std::ostream& out) {
  const gguf::File f = gguf::map(opts.in_path);
  safetensors::File s;
  for (const auto& t : f.tensors) {
    std::vector<float> v(static_cast<std::size_t>(t.numel()));
    dequantize(t.type, t.data().data(), t.numel(), v.data());
    const std::vector<std::int64_t> shape(t.dims.rbegin(), t.dims.rend());
    s.add(t.name, shape, v.data(), v.size());
    s.metadata.emplace_back("gguf.type." + t.name, quant::to_string(t.type));
  }
  write_file_atomic(opts.out_path, safetensors::serialize(s), opts.force);
  out << "wrote " << opts.out_path << ": " << f.tensors.size() << " tensors as F32\n";
  return 0;
}

// The float tensors of a safetensors file as GGUF: those of two or more dimensions whose rows are
// whole blocks in --type, the rest in F32.
int quantize_file(const GgufOptions& opts, std::ostream& out) {
  const quant::GgmlType type = quant::parse_ggml_type(opts.type, "--type");
  const safetensors::File in = safetensors::map(opts.in_path);
  gguf::File g;
  if (!opts.arch.empty()) g.set("general.architecture", gguf::Value::of_string(opts.arch));
  int quantized = 0;
  for (const auto& t : in.tensors) {
    if (!safetensors::is_float(t.dtype)) {
      throw InputError(opts.in_path + ": tensor " + t.name + " is " +
                       safetensors::dtype_name(t.dtype) + ", not a float tensor");
    }
    const auto d = t.float_values();
    std::vector<float> v(d.begin(), d.end());
    std::vector<std::int64_t> dims(t.shape.rbegin(), t.shape.rend());
    if (dims.empty()) dims = {1};
    const auto shape = quant::block_shape(type);
    const bool blocks = t.shape.size() >= 2 && dims[0] % shape.values == 0;
    const quant::GgmlType tt = blocks ? type : quant::GgmlType::f32;
    std::vector<std::uint8_t> bytes(static_cast<std::size_t>(
        quant::row_bytes(tt, static_cast<std::int64_t>(v.size()), "tensor " + t.name)));
    quantize(tt, v.data(), static_cast<std::int64_t>(v.size()), bytes.data());
    g.add(t.name, tt, dims, std::move(bytes));
    quantized += blocks;
  }
  gguf::write(g, opts.out_path, opts.force);
  out << "wrote " << opts.out_path << ": " << quantized << " tensors in " << opts.type << ", "
      << g.tensors.size() - quantized << " in F32\n";
  return 0;
}

}  // namespace

CLI::App* add_gguf_commands(CLI::App& app, GgufOptions& opts) {
  CLI::App* g = app.add_subcommand(
      "gguf", "Read, dequantize and write GGUF files with teo's exact block formats");
  g->require_subcommand(1);
  CLI::App* inspect = g->add_subcommand("inspect", "Print a GGUF file's metadata and tensors");
  inspect->add_option("file", opts.in_path, "GGUF file")->required();
  inspect->add_flag("--json", opts.json, "print JSON (every metadata value in full)");
  inspect->callback([&opts] { opts.command = "inspect"; });
  CLI::App* deq = g->add_subcommand(
      "dequantize", "Write every tensor's exact values as F32 safetensors (PyTorch's dim order)");
  deq->add_option("file", opts.in_path, "GGUF file")->required();
  deq->add_option("--out", opts.out_path, "safetensors file to write")->required();
  deq->add_flag("--force", opts.force, "overwrite --out");
  deq->callback([&opts] { opts.command = "dequantize"; });
  CLI::App* q = g->add_subcommand(
      "quantize", "Write a safetensors file's float tensors as GGUF, in --type where rows allow");
  q->add_option("file", opts.in_path, "safetensors file")->required();
  q->add_option("--out", opts.out_path, "GGUF file to write")->required();
  q->add_option("--type", opts.type, "Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, MXFP4, ...")
      ->required();
  q->add_option("--arch", opts.arch, "general.architecture to record");
  q->add_flag("--force", opts.force, "overwrite --out");
  q->callback([&opts] { opts.command = "quantize"; });
  return g;
}

int run_gguf(const GgufOptions& opts, std::ostream& out) {
  if (opts.command == "inspect") return inspect(opts, out);
  if (opts.command == "dequantize") return dequantize_file(opts, out);
  return quantize_file(opts, out);
}

}  // namespace teo::cli
