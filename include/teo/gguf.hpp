// A strict reader and writer of GGUF, llama.cpp's file format (its docs/gguf.md; version 3, and 2,
// which has the same little-endian layout): the magic "GGUF", the version, the tensor and metadata
// counts, the metadata's typed key-value pairs, the tensor infos (name, dimensions with the
// fastest-varying first, ggml type, offset), padding to the alignment (`general.alignment`, 32 when
// absent), and the tensors' data, each at its offset. The tensors' blocks are teo/quant.hpp's.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "teo/quant.hpp"

namespace teo::gguf {

// GGUF's metadata value types (gguf_type).
enum class ValueType : std::uint32_t {
  u8 = 0,
  i8 = 1,
  u16 = 2,
  i16 = 3,
  u32 = 4,
  i32 = 5,
  f32 = 6,
  boolean = 7,
  string = 8,
  array = 9,
  u64 = 10,
  i64 = 11,
  f64 = 12,
};
// GGUF's names of the types ("UINT8", ..., "ARRAY", "FLOAT64").
const char* to_string(ValueType t);

// A metadata value. Integers are held in `u` (unsigned types) or `i` (signed and bool), floats in
// `f` (an f32 exactly) with their bits in `u` (what is written, NaN payloads included), strings in
// `s`; an array holds `items`, each of type `item_type`.
struct Value {
  ValueType type = ValueType::u32;
  std::uint64_t u = 0;
  std::int64_t i = 0;
  double f = 0;
  std::string s;
  ValueType item_type = ValueType::u32;
  std::vector<Value> items;

  static Value of_u32(std::uint32_t v);
  static Value of_u64(std::uint64_t v);
  static Value of_i32(std::int32_t v);
  static Value of_f32(float v);
  static Value of_bool(bool v);
  static Value of_string(std::string v);
  static Value of_strings(const std::vector<std::string>& v);

  bool operator==(const Value& o) const;
};

struct Tensor {
  std::string name;
  quant::GgmlType type = quant::GgmlType::f32;
  // GGUF's order: dims[0] varies fastest (a PyTorch weight (out, in) has dims {in, out}).
  std::vector<std::int64_t> dims;
  std::vector<std::uint8_t> bytes;  // owned, or empty for a mapped file's tensor
  const std::uint8_t* mapped = nullptr;
  std::size_t mapped_size = 0;

  std::span<const std::uint8_t> data() const {
    return mapped ? std::span<const std::uint8_t>(mapped, mapped_size)
                  : std::span<const std::uint8_t>(bytes);
  }
  std::int64_t numel() const;
  // The dims as PyTorch orders them (slowest first), "[4096, 11008]".
  std::string shape_str() const;
  // The exact values (quant::dequantize_block of each block), in memory order.
  std::vector<float> values() const;
};

struct File {
  std::uint32_t version = 3;
  std::vector<std::pair<std::string, Value>> metadata;  // in file order
  std::vector<Tensor> tensors;                          // in file order
  std::shared_ptr<const void> backing;                  // a mapped file's mapping

  const Value* meta(const std::string& key) const;
  const Tensor* find(const std::string& name) const;
  // general.alignment, or 32.
  std::uint64_t alignment() const;

  // Appends a tensor of `type` and `dims` whose bytes are `bytes`: ShapeError for a bad shape
  // (dims[0] not whole blocks, a dimension below 1, more than 4 dims), FormatError for a duplicate
  // or overlong name or a byte count that does not match.
  void add(const std::string& name, quant::GgmlType type, std::vector<std::int64_t> dims,
           std::vector<std::uint8_t> bytes);
  // Appends or replaces a metadata key.
  void set(const std::string& key, Value v);
};

struct Limits {
  std::uint64_t max_file_bytes = std::uint64_t{1} << 36;  // 64 GiB
  // The items of all metadata arrays together (a tokenizer's vocabulary, merges and scores are a
  // few hundred thousand each).
  std::uint64_t max_metadata_items = std::uint64_t{1} << 23;
};

// Parses a whole file held in memory. FormatError, naming `source` and the rule, for: a short file;
// a wrong magic; a version other than 2 or 3 (a big-endian file is named as one); counts that
// cannot fit in the file; a string past the end or not UTF-8; a duplicate or empty key; an unknown
// value type, a bool other than 0 or 1, arrays nested over 8 deep, more array items in all than
// Limits::max_metadata_items; general.alignment not a UINT32
// power of two; a tensor name that is empty, of 64 bytes or more, or repeated; 0 or more than 4
// dims, a dimension below 1, an element or byte count over 2^62; a ggml type teo does not support
// (named); dims[0] not whole blocks; an offset other than the previous tensor's end rounded up to
// the alignment (llama.cpp's rule); data past the end of the file, padding that is not zeros, or
// bytes after the last tensor's padding; and an invalid block (quant::check_block), named with its
// tensor and block index.
File parse(std::string_view bytes, const std::string& source, const Limits& limits = {});
// Reads (or maps: the tensors view the mapping, as safetensors::map's do) and parses `path`.
// FileError when it cannot be read; FormatError as parse().
File read(const std::string& path, const Limits& limits = {});
File map(const std::string& path, const Limits& limits = {});

// The file's bytes: header, metadata and tensor infos in order, each tensor's data at the next
// multiple of the alignment, zero padding after every tensor. parse(serialize(f)) gives f back,
// and serialize(parse(b)) gives b back for every file that a standard writer (llama.cpp's,
// gguf-py's) wrote.
std::string serialize(const File& file);
// serialize() written to `path` whole or not at all (write_file_atomic).
void write(const File& file, const std::string& path, bool overwrite);

}  // namespace teo::gguf
