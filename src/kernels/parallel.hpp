// The one place kernels get threads: a process-wide tbb::task_arena sized by set_num_threads().
#pragma once

#include <cstdint>

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>
#include <tbb/partitioner.h>
#include <tbb/task_arena.h>

namespace teo::detail {

tbb::task_arena& arena();

// Runs body(i) for i in [0, n) in the arena, statically partitioned: each index is owned by one
// task, so results never depend on the thread count or on scheduling.
template <class F>
void parallel_for_each(std::int64_t n, F&& body) {
  if (n <= 0) return;
  if (n == 1) {
    body(std::int64_t{0});
    return;
  }
  arena().execute([&] {
    tbb::parallel_for(
        tbb::blocked_range<std::int64_t>(0, n, 1),
        [&](const tbb::blocked_range<std::int64_t>& r) {
          for (std::int64_t i = r.begin(); i != r.end(); ++i) body(i);
        },
        tbb::static_partitioner());
  });
}

}  // namespace teo::detail
