// A small, strict reader and writer of the public safetensors format: an 8-byte little-endian
// header length N, N bytes of JSON header, then the tensors' bytes back to back. teo writes F32,
// F64, I64, I32, I8 and U8; it also reads the reduced float formats a low-precision candidate may
// store: BF16, F16, F8_E4M3 (OCP "fn": no infinities) and F8_E5M2.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "teo/errors.hpp"

namespace teo::safetensors {

enum class DType { F32, F64, I64, U8, BF16, F16, F8_E4M3, F8_E5M2, I32, I8 };

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
  else if constexpr (std::is_same_v<T, std::int32_t>)
    return DType::I32;
  else if constexpr (std::is_same_v<T, std::int8_t>)
    return DType::I8;
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
  // A tensor of a mapped file (map()) owns no bytes: they are the mapping's, at `mapped`, valid
  // while its File (or a copy of the File) lives; a Tensor copied out of it does not keep them.
  const unsigned char* mapped = nullptr;
  std::size_t mapped_size = 0;

  // The tensor's bytes, owned or mapped.
  std::span<const unsigned char> data() const {
    return mapped ? std::span<const unsigned char>(mapped, mapped_size)
                  : std::span<const unsigned char>(bytes);
  }
  std::int64_t numel() const;
  std::string shape_str() const;

  // The elements of a float tensor (any float dtype) as doubles, exactly; FormatError otherwise.
  std::vector<double> float_values() const;

  // The elements of an integer tensor (I64, I32 or I8) as int64; FormatError otherwise.
  std::vector<std::int64_t> int_values() const;

  // The elements as T; FormatError when T is not this tensor's dtype.
  template <class T>
  std::vector<T> values() const {
    if (dtype_of<T>() != dtype) {
      throw FormatError("tensor " + name + " has dtype " + dtype_name(dtype) + ", expected " +
                        dtype_name(dtype_of<T>()));
    }
    const auto b = data();
    std::vector<T> out(b.size() / sizeof(T));
    if (!out.empty()) std::memcpy(out.data(), b.data(), b.size());
    return out;
  }
};

struct File {
  // `__metadata__`, in the order written (the format allows only string values).
  std::vector<std::pair<std::string, std::string>> metadata;
  // The tensors in the order of their data offsets.
  std::vector<Tensor> tensors;
  // What a mapped file's tensors point into (the mapping, unmapped with the last copy).
  std::shared_ptr<const void> backing;

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

// Maps `path` read-only and parses it as parse() does; the tensors are views into the mapping
// (Tensor::mapped), which lives as long as the File or a copy of it. Only the pages a reader
// touches are read, and release() gives them back, so a check of two large files holds about one
// tensor of each in memory. FileError and FormatError as read().
File map(const std::string& path, const Limits& limits = {});

// Gives back the memory of a mapped tensor's pages once it has been read (they are read again
// from the file if touched later); nothing for an owned tensor.
void release(const Tensor& t);

// A tensor's entry in a header: its name, dtype and shape, in file order.
struct Entry {
  std::string name;
  DType dtype = DType::F32;
  std::vector<std::int64_t> shape;

  std::uint64_t byte_size() const;
};

// The 8-byte length and the header of a file with `metadata` and `entries` (in order), exactly as
// serialize() writes them.
std::string header_bytes(const std::vector<std::pair<std::string, std::string>>& metadata,
                         const std::vector<Entry>& entries);

// Writes a file too large to hold in memory, tensor by tensor. The header is written first, from
// the names, dtypes and shapes given up front; each tensor's bytes go to their place in a temporary
// file beside `path` as soon as write() is given them, in any order; commit() renames the complete
// file into place. The result is byte for byte what serialize() gives for the same file. A Writer
// destroyed before commit() (an error, an interruption) removes its temporary file: nothing ever
// appears under `path` half written.
class Writer {
 public:
  // FileError when `path` is a directory, its directory does not exist, or it exists and not
  // `overwrite`; FormatError for an invalid or repeated name; ShapeError for a bad shape.
  Writer(std::string path, std::vector<std::pair<std::string, std::string>> metadata,
         std::vector<Entry> entries, bool overwrite);
  ~Writer();
  Writer(const Writer&) = delete;
  Writer& operator=(const Writer&) = delete;

  // FormatError for a name not in the header, one written twice, or a size that is not the
  // entry's; FileError when the write fails.
  void write(const std::string& name, const void* data, std::size_t bytes);
  template <class T>
  void write(const std::string& name, const T* data, std::size_t count) {
    write(name, static_cast<const void*>(data), count * sizeof(T));
  }

  // Whether the header holds `name`.
  bool has(const std::string& name) const { return index_.contains(name); }

  // The file as written so far, mapped (every tensor must have been written).
  File contents() const;

  // Replaces the metadata; commit() moves the data when the header's length changes.
  void set_metadata(std::vector<std::pair<std::string, std::string>> metadata);

  // Checks every tensor was written, syncs, and renames the file into place; returns its size.
  std::uint64_t commit();

 private:
  std::string path_, tmp_;
  bool overwrite_;
  int fd_ = -1;
  std::vector<std::pair<std::string, std::string>> metadata_;
  std::vector<Entry> entries_;
  std::map<std::string, std::size_t> index_;
  std::vector<std::uint64_t> offset_;  // of each entry's data, from the file's start
  std::vector<bool> written_;
  std::uint64_t header_size_ = 0, data_size_ = 0;
};

// The file's bytes: the header is compact JSON with `__metadata__` first and then the tensors in
// order, padded with spaces to a multiple of 8 bytes; the data follows in the same order.
std::string serialize(const File& file);

}  // namespace teo::safetensors
