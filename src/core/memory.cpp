#include <bit>
#include <cstdlib>
#include <limits>
#include <map>
#include <mutex>
#include <new>

#include "teo/tensor.hpp"

namespace teo::memory {

namespace {

constexpr std::align_val_t kAlign{64};
constexpr std::size_t kCachedFrom = std::size_t{1} << 20;

// TEO_CACHE_MB: a whole number of MiB, at most 2^24 (16 TiB), so that the shift to bytes cannot
// overflow. Returns false for anything else.
bool parse_cache_mb(const char* v, std::size_t* bytes) {
  if (!v || !*v) return false;
  std::size_t mb = 0;
  for (const char* p = v; *p; ++p) {
    if (*p < '0' || *p > '9') return false;
    mb = mb * 10 + static_cast<std::size_t>(*p - '0');
    if (mb > (std::size_t{1} << 24)) return false;
  }
  *bytes = mb << 20;
  return true;
}

struct Cache {
  std::mutex mu;
  std::multimap<std::size_t, void*> blocks;  // size class -> free block of that size
  std::size_t bytes = 0;
  std::size_t limit = [] {
    // TEO_CACHE_MB overrides the default of 4 GiB; 0 disables the cache. A bad value keeps the
    // default here, and check_environment() (called by init_from_environment) names it.
    std::size_t limit_bytes = std::size_t{4} << 30;
    parse_cache_mb(std::getenv("TEO_CACHE_MB"), &limit_bytes);
    return limit_bytes;
  }();
};

// Never destroyed: buffers owned by other statics and by thread_locals of TBB's worker threads
// (the GEMM packing panels) are freed during exit, in an order no translation unit controls, and
// each of those frees goes through the cache. A destroyed cache would take them into a dead map
// and corrupt the heap. Its blocks stay reachable until the process ends.
Cache& cache() {
  static Cache* c = new Cache;
  return *c;
}

// The size a large block really has: `bytes` rounded up to the next of 4 classes per power of two
// (2^k, 1.25, 1.5 and 1.75 times 2^k), so that activations of batches of similar shape share
// blocks instead of each exact size keeping its own. At most 25% of a block is unused.
std::size_t size_class(std::size_t bytes) {
  const std::size_t top = std::size_t{1} << (std::bit_width(bytes) - 1);  // largest 2^k <= bytes
  const std::size_t step = top / 4;
  if (bytes > std::numeric_limits<std::size_t>::max() - step) throw std::bad_alloc();
  return (bytes + step - 1) / step * step;
}

}  // namespace

void check_environment() {
  const char* v = std::getenv("TEO_CACHE_MB");
  std::size_t bytes = 0;
  if (v && *v && !parse_cache_mb(v, &bytes)) {
    throw ConfigError(std::string("TEO_CACHE_MB must be a whole number of MiB in [0, 16777216], ") +
                      "got \"" + v + "\"");
  }
}

void* allocate(std::size_t bytes) {
  if (bytes >= kCachedFrom) {
    bytes = size_class(bytes);
    Cache& c = cache();
    std::lock_guard<std::mutex> lock(c.mu);
    auto it = c.blocks.find(bytes);
    if (it != c.blocks.end()) {
      void* p = it->second;
      c.blocks.erase(it);
      c.bytes -= bytes;
      return p;
    }
  }
  return ::operator new(bytes, kAlign);
}

void deallocate(void* p, std::size_t bytes) noexcept {
  if (!p) return;
  if (bytes >= kCachedFrom) {
    bytes = size_class(bytes);  // the size allocate() gave it
    Cache& c = cache();
    std::lock_guard<std::mutex> lock(c.mu);
    if (c.bytes + bytes <= c.limit) {
      try {
        c.blocks.emplace(bytes, p);
        c.bytes += bytes;
        return;
      } catch (...) {
        // no room for the bookkeeping: free the block instead
      }
    }
  }
  ::operator delete(p, kAlign);
}

void release_cached_memory() noexcept {
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mu);
  for (auto& [size, p] : c.blocks) ::operator delete(p, kAlign);
  c.blocks.clear();
  c.bytes = 0;
}

std::size_t cached_bytes() noexcept {
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mu);
  return c.bytes;
}

std::size_t cached_memory_limit() noexcept {
  return cache().limit;
}

}  // namespace teo::memory
