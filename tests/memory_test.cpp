// The large-buffer cache behind Tensor: reuse of same-size blocks, alignment, release, and that
// reused memory is re-initialised by Tensor (a cached block never leaks old values).
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <new>
#include <string>

#include "support.hpp"
#include "teo/backend.hpp"
#include "teo/tensor.hpp"

namespace teo {
namespace {

TEST(Memory, LargeBlocksAreReusedAlignedAndReleased) {
  memory::release_cached_memory();
  const std::size_t bytes = std::size_t{3} << 20;
  void* p = memory::allocate(bytes);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(p) % 64, 0u);
  memory::deallocate(p, bytes);
  EXPECT_EQ(memory::cached_bytes(), bytes);
  void* q = memory::allocate(bytes);  // the same size comes back from the cache
  EXPECT_EQ(q, p);
  EXPECT_EQ(memory::cached_bytes(), 0u);
  void* r = memory::allocate(bytes + 64);  // another size class does not
  EXPECT_NE(r, q);
  memory::deallocate(q, bytes);
  memory::deallocate(r, bytes + 64);
  // Sizes are rounded up to 4 classes per power of two: 3 MiB + 64 bytes takes a 3.5 MiB block,
  // and any size up to 3.5 MiB reuses it.
  EXPECT_EQ(memory::cached_bytes(), 2 * bytes + (std::size_t{1} << 19));
  void* s = memory::allocate(bytes + (std::size_t{1} << 19));
  EXPECT_EQ(s, r);
  memory::deallocate(s, bytes + 1000);
  EXPECT_EQ(memory::cached_bytes(), 2 * bytes + (std::size_t{1} << 19));
  EXPECT_THROW(memory::allocate(std::numeric_limits<std::size_t>::max() - 10), std::bad_alloc);
  memory::release_cached_memory();
  EXPECT_EQ(memory::cached_bytes(), 0u);
  void* small = memory::allocate(100);  // small blocks bypass the cache
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(small) % 64, 0u);
  memory::deallocate(small, 100);
  EXPECT_EQ(memory::cached_bytes(), 0u);
  EXPECT_GT(memory::cached_memory_limit(), 0u);
}

TEST(Memory, TensorsOnReusedBlocksStartAtZero) {
  const index_t n = index_t{1} << 19;  // 4 MiB of double
  {
    Tensor<double> t({n});
    t.fill(7.0);
  }
  Tensor<double> u({n});  // very likely the same block
  for (index_t i = 0; i < n; i += 4097) ASSERT_EQ(u[i], 0.0);
  EXPECT_EQ(u[n - 1], 0.0);
}

// TEO_CACHE_MB is a whole number of MiB; anything else (junk, a sign, a value whose shift to bytes
// would overflow) is a ConfigError naming the variable, raised by init_from_environment.
TEST(Memory, CacheSizeVariableRejectsJunkByName) {
  const char* old = std::getenv("TEO_CACHE_MB");
  const std::string saved = old ? old : "";
  for (const char* bad : {"12x", "-1", "1e3", " 5", "18446744073709551615", "16777217"}) {
    ::setenv("TEO_CACHE_MB", bad, 1);
    try {
      memory::check_environment();
      ADD_FAILURE() << "TEO_CACHE_MB=" << bad << " was accepted";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("TEO_CACHE_MB"), std::string::npos) << e.what();
    }
    EXPECT_THROW(init_from_environment(), ConfigError) << bad;
  }
  for (const char* good : {"0", "512", "16777216"}) {
    ::setenv("TEO_CACHE_MB", good, 1);
    EXPECT_NO_THROW(memory::check_environment()) << good;
  }
  if (old)
    ::setenv("TEO_CACHE_MB", saved.c_str(), 1);
  else
    ::unsetenv("TEO_CACHE_MB");
}

}  // namespace
}  // namespace teo
