// A small, strict reader and writer of the public safetensors format: an 8-byte little-endian
// header length N, N bytes of JSON header, then the tensors' bytes back to back. teo writes F32,
// F64, I64 and U8; it also reads the reduced float formats a low-precision candidate may store:
// BF16, F16, F8_E4M3 (OCP "fn": no infinities) and F8_E5M2.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "teo/errors.hpp"

namespace teo::safetensors {

enum class DType { F32, F64, I64, U8, BF16, F16, F8_E4M3, F8_E5M2 };

const char* dtype_name(DType d);
std::size_t dtype_size(DType d);
bool is_float(DType d);

template <class T>
constexpr DType dtype_of() {
  if constexpr (std::is_same_v<T, float>)
    return DType::F32;
  else if constexpr (std::is_same_v<T, double>)
    return DType::F64;
  else if constexpr (std::is_same_v<T, std::int64_t>)
    return DType::I64;
  else {
    static_assert(std::is_same_v<T, std::uint8_t>, "safetensors: unsupported element type");
    return DType::U8;
  }
}

// Reader limits. A header longer than max_header_bytes, or a file longer than max_file_bytes, is
// rejected before it is read.
struct Limits {
  std::uint64_t max_header_bytes = 100'000'000;
  std::uint64_t max_file_bytes = std::uint64_t{1} << 34;  // 16 GiB
};

struct Tensor {
  std::string name;
  DType dtype = DType::F32;
  std::vector<std::int64_t> shape;
  std::vector<unsigned char> bytes;  // numel * dtype_size(dtype), little-endian

  std::int64_t numel() const;
  std::string shape_str() const;

  // The elements of a float tensor (any float dtype) as doubles, exactly; FormatError otherwise.
  std::vector<double> float_values() const;

  // The elements as T; FormatError when T is not this tensor's dtype.
  template <class T>
  std::vector<T> values() const {
    if (dtype_of<T>() != dtype) {
      throw FormatError("tensor " + name + " has dtype " + dtype_name(dtype) + ", expected " +
                        dtype_name(dtype_of<T>()));
    }
    std::vector<T> out(bytes.size() / sizeof(T));
    if (!out.empty()) std::memcpy(out.data(), bytes.data(), bytes.size());
    return out;
  }
};

struct File {
  // `__metadata__`, in the order written (the format allows only string values).
  std::vector<std::pair<std::string, std::string>> metadata;
  // The tensors in the order of their data offsets.
  std::vector<Tensor> tensors;

  const Tensor* find(const std::string& name) const;
  const std::string* meta(const std::string& key) const;

  // Appends a tensor; ShapeError on a negative dimension or overflow, FormatError on a duplicate
  // name or a size that does not match the shape.
  void add(const std::string& name, DType dtype, std::vector<std::int64_t> shape, const void* data,
           std::size_t bytes);
  template <class T>
  void add(const std::string& name, std::vector<std::int64_t> shape, const T* data,
           std::size_t count) {
    add(name, dtype_of<T>(), std::move(shape), data, count * sizeof(T));
  }
};

// Parses a whole file held in memory. Throws FormatError, naming `source` and the broken rule,
// for: a short file; a header length over the limit or past the end; a header that is not a JSON
// object, has duplicate keys, or whose `__metadata__` is not an object of strings; an entry that
// is not {dtype, shape, data_offsets} with a supported dtype, non-negative integer dimensions and
// [begin, end] offsets; a byte size that is not numel * dtype size (overflow checked); offsets
// that do not tile the data block from 0 without holes or overlaps; a file length that is not
// exactly 8 + N + the data block.
File parse(std::string_view bytes, const std::string& source, const Limits& limits = {});

// Reads and parses `path`. FileError when it cannot be opened or read, FormatError as parse().
File read(const std::string& path, const Limits& limits = {});

// The file's bytes: the header is compact JSON with `__metadata__` first and then the tensors in
// order, padded with spaces to a multiple of 8 bytes; the data follows in the same order.
std::string serialize(const File& file);

}  // namespace teo::safetensors
