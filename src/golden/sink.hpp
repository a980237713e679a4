// Internal to src/golden: where a generated case goes, a File in memory or a file written as it
// is computed. Model cases (generate.cpp) and op cases (ops.cpp) are written through it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "teo/errors.hpp"
#include "teo/safetensors.hpp"
#include "teo/tensor.hpp"

namespace teo::golden::detail {

using safetensors::DType;
using safetensors::File;

// One tensor of a golden file: its name, dtype, shape and bytes (owned by a run or the params).
struct Out {
  std::string name;
  DType dtype;
  std::vector<std::int64_t> shape;
  const void* data;
  std::size_t bytes;
};

template <class T>
Out out_of(std::string name, std::vector<std::int64_t> shape, const T* data, std::size_t count) {
  return {std::move(name), safetensors::dtype_of<T>(), std::move(shape), data, count * sizeof(T)};
}

template <class Real>
Out out_of(std::string name, const Tensor<Real>& t) {
  return out_of(std::move(name), t.shape().dims(), t.data(), static_cast<std::size_t>(t.numel()));
}

using Metadata = std::vector<std::pair<std::string, std::string>>;

// Where a generated case goes: a File in memory, or a file written as it is computed. The header
// (metadata and entries) comes first; put() stores a tensor the header holds and skips the rest.
class Sink {
 public:
  virtual ~Sink() = default;
  virtual void begin(const Metadata& meta, std::vector<safetensors::Entry> entries) = 0;
  virtual void put(const Out& o) = 0;
  // Everything put so far, as a File (after every entry was put).
  virtual const File& contents() = 0;
  virtual void finish(const Metadata& meta) = 0;
};

class MemorySink final : public Sink {
 public:
  void begin(const Metadata& meta, std::vector<safetensors::Entry> entries) override {
    f_.metadata = meta;
    for (auto& e : entries) {
      index_[e.name] = f_.tensors.size();
      safetensors::Tensor t;
      t.bytes.resize(e.byte_size());
      t.name = std::move(e.name);
      t.dtype = e.dtype;
      t.shape = std::move(e.shape);
      f_.tensors.push_back(std::move(t));
    }
  }
  void put(const Out& o) override {
    const auto it = index_.find(o.name);
    if (it == index_.end()) return;
    auto& t = f_.tensors[it->second];
    if (o.bytes != t.bytes.size()) {
      throw FormatError("safetensors: tensor " + o.name + " has " + std::to_string(o.bytes) +
                        " bytes, its shape needs " + std::to_string(t.bytes.size()));
    }
    if (o.bytes) std::memcpy(t.bytes.data(), o.data, o.bytes);
  }
  const File& contents() override { return f_; }
  void finish(const Metadata& meta) override { f_.metadata = meta; }
  File take() { return std::move(f_); }

 private:
  File f_;
  std::map<std::string, std::size_t> index_;
};

class FileSink final : public Sink {
 public:
  FileSink(std::string path, bool overwrite) : path_(std::move(path)), overwrite_(overwrite) {}
  void begin(const Metadata& meta, std::vector<safetensors::Entry> entries) override {
    w_.emplace(path_, meta, std::move(entries), overwrite_);
  }
  void put(const Out& o) override {
    if (w_->has(o.name)) w_->write(o.name, o.data, o.bytes);
  }
  const File& contents() override {
    if (!mapped_) mapped_ = w_->contents();
    return *mapped_;
  }
  void finish(const Metadata& meta) override {
    mapped_.reset();
    w_->set_metadata(meta);
    size_ = w_->commit();
  }
  std::uint64_t size() const { return size_; }

 private:
  std::string path_;
  bool overwrite_;
  std::optional<safetensors::Writer> w_;
  std::optional<File> mapped_;
  std::uint64_t size_ = 0;
};

}  // namespace teo::golden::detail
