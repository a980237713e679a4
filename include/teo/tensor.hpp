// Tensor<Real>: an owning, row-major, 64-byte aligned buffer with a checked shape.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include "teo/errors.hpp"

namespace teo {

// A list of dimensions whose element count is checked for overflow on construction.
class Shape {
 public:
  Shape() = default;
  Shape(std::initializer_list<index_t> dims) : dims_(dims) { check(); }
  explicit Shape(std::vector<index_t> dims) : dims_(std::move(dims)) { check(); }

  const std::vector<index_t>& dims() const { return dims_; }
  std::size_t rank() const { return dims_.size(); }
  index_t operator[](std::size_t i) const { return dims_[i]; }
  index_t numel() const { return numel_; }
  // Equal shapes hold equal element counts: Shape() (no tensor, 0 elements) is not Shape({}) (a
  // scalar, 1 element).
  bool operator==(const Shape& o) const { return dims_ == o.dims_ && numel_ == o.numel_; }
  std::string str() const {
    std::string s = "[";
    for (std::size_t i = 0; i < dims_.size(); ++i) s += (i ? ", " : "") + std::to_string(dims_[i]);
    return s + "]";
  }

 private:
  void check() {
    numel_ = 1;
    for (index_t d : dims_) {
      if (d < 0) throw ShapeError("shape dimension is negative: " + std::to_string(d));
      numel_ = checked_mul(numel_, d, "shape element count");
    }
  }
  std::vector<index_t> dims_;
  index_t numel_ = 0;
};

// Large buffers (1 MiB and up) come from a process-wide cache of freed blocks of the same size
// class (4 classes per power of two, so a block is at most 25% larger than asked for),
// so that the activations of repeated forward/backward passes reuse memory whose pages are
// already mapped instead of faulting in fresh pages every time. The cache holds at most
// cached_memory_limit() bytes; release_cached_memory() returns everything to the system.
namespace memory {
void* allocate(std::size_t bytes);  // 64-byte aligned
void deallocate(void* p, std::size_t bytes) noexcept;
void release_cached_memory() noexcept;
std::size_t cached_bytes() noexcept;
std::size_t cached_memory_limit() noexcept;
// ConfigError naming TEO_CACHE_MB when it is set to anything but a whole number of MiB in
// [0, 2^24]; the cache itself then keeps its default of 4 GiB.
void check_environment();
}  // namespace memory

template <class T>
struct AlignedAllocator {
  using value_type = T;
  AlignedAllocator() = default;
  template <class U>
  AlignedAllocator(const AlignedAllocator<U>&) {}
  T* allocate(std::size_t n) {
    if (n > std::numeric_limits<std::size_t>::max() / sizeof(T)) throw std::bad_array_new_length();
    return static_cast<T*>(memory::allocate(n * sizeof(T)));
  }
  void deallocate(T* p, std::size_t n) noexcept { memory::deallocate(p, n * sizeof(T)); }
  // Elements a vector value-initialises (resize, the size constructor) are left uninitialised:
  // Tensor zero-fills explicitly (reset), except where a caller overwrites every element
  // (reset_for_overwrite), and the GEMM's packing buffers are always overwritten.
  template <class U>
  void construct(U* p) noexcept {
    ::new (static_cast<void*>(p)) U;
  }
  template <class U, class... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
  template <class U>
  bool operator==(const AlignedAllocator<U>&) const {
    return true;
  }
};

template <class Real>
class Tensor {
 public:
  Tensor() = default;
  explicit Tensor(Shape shape) { reset(std::move(shape)); }
  Tensor(std::initializer_list<index_t> dims) : Tensor(Shape(dims)) {}

  // Gives the tensor a new shape, all zero, keeping its buffer when that is large enough: the
  // activations of repeated passes over batches of varying length then reuse warm memory.
  void reset(Shape shape) {
    reset_for_overwrite(std::move(shape));
    zero();
  }
  void reset(std::initializer_list<index_t> dims) { reset(Shape(dims)); }

  // Gives the tensor a new shape for a caller that overwrites every element before anything reads
  // it: no zero-fill (the values are whatever the buffer held). The forward pass's activations use
  // it, which saves writing them twice. Clearing first means a buffer that has to grow is not
  // copied into its replacement.
  void reset_for_overwrite(Shape shape) {
    checked_mul(shape.numel(), static_cast<index_t>(sizeof(Real)), "tensor byte count");
    shape_ = std::move(shape);
    data_.clear();
    data_.resize(static_cast<std::size_t>(shape_.numel()));
  }
  void reset_for_overwrite(std::initializer_list<index_t> dims) {
    reset_for_overwrite(Shape(dims));
  }
  static Tensor for_overwrite(Shape shape) {
    Tensor t;
    t.reset_for_overwrite(std::move(shape));
    return t;
  }

  const Shape& shape() const { return shape_; }
  index_t numel() const { return shape_.numel(); }
  index_t dim(std::size_t i) const { return shape_[i]; }
  bool empty() const { return data_.empty(); }
  // True when the tensor was never given a shape (an absent optional activation or parameter).
  bool absent() const { return shape_.rank() == 0 && data_.empty(); }

  Real* data() { return data_.data(); }
  const Real* data() const { return data_.data(); }
  Real& operator[](index_t i) { return data_[static_cast<std::size_t>(i)]; }
  const Real& operator[](index_t i) const { return data_[static_cast<std::size_t>(i)]; }
  Real* begin() { return data_.data(); }
  Real* end() { return data_.data() + data_.size(); }
  const Real* begin() const { return data_.data(); }
  const Real* end() const { return data_.data() + data_.size(); }

  void fill(Real v) {
    for (auto& x : data_) x = v;
  }
  // +0.0 is the all-zero bit pattern.
  void zero() {
    if (!data_.empty()) std::memset(data_.data(), 0, data_.size() * sizeof(Real));
  }

 private:
  Shape shape_;
  std::vector<Real, AlignedAllocator<Real>> data_;
};

}  // namespace teo
