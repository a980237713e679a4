// The one place kernels get threads: a process-wide tbb::task_arena sized by set_num_threads().
// Every parallel loop hands each index (or fixed-size block of indices) to exactly one task, so no
// result depends on the thread count or on scheduling.
#pragma once

#include <algorithm>
#include <cstdint>

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>
#include <tbb/partitioner.h>
#include <tbb/task_arena.h>

#include "teo/backend.hpp"
#include "teo/fp8.hpp"
#include "teo/types.hpp"

namespace teo::detail {

tbb::task_arena& arena();

// True inside a task of for_blocks(): nested kernels (a GEMM inside an attention head) then run
// on the calling thread instead of forking again.
bool in_parallel_region();
void set_in_parallel_region(bool v);

// The reduced precision a float computation on this thread emulates (docs/semantics.md, "Reduced
// precision"): fp32 for none. gemm() rounds its float operands to it, and the attention kernels
// round the score and probability rows they store. Tasks of parallel_for_each inherit the
// caller's, with the fp8 recipe that Precision::fp8 uses. Set both with EmulationScope.
Precision emulation();
void set_emulation(Precision p);
const Fp8Recipe& fp8_recipe();
void set_fp8_recipe(const Fp8Recipe& r);
// Without a recipe the scope keeps the thread's (a layer's pass inside an op case's run keeps the
// case's recipe).
class EmulationScope {
 public:
  explicit EmulationScope(Precision p) : EmulationScope(p, fp8_recipe()) {}
  EmulationScope(Precision p, const Fp8Recipe& fp8)
      : outer_(emulation()), outer_fp8_(fp8_recipe()) {
    set_emulation(p);
    set_fp8_recipe(fp8);
  }
  ~EmulationScope() {
    set_emulation(outer_);
    set_fp8_recipe(outer_fp8_);
  }
  EmulationScope(const EmulationScope&) = delete;
  EmulationScope& operator=(const EmulationScope&) = delete;

 private:
  Precision outer_;
  Fp8Recipe outer_fp8_;
};

// Runs body(i) for i in [0, n) in the arena with a static partitioner.
template <class F>
void parallel_for_each(std::int64_t n, F&& body) {
  if (n <= 0) return;
  if (n == 1 || num_threads() == 1 || in_parallel_region()) {
    for (std::int64_t i = 0; i < n; ++i) body(i);
    return;
  }
  const Precision emulated = emulation();
  const Fp8Recipe fp8 = fp8_recipe();
  arena().execute([&] {
    tbb::parallel_for(
        tbb::blocked_range<std::int64_t>(0, n, 1),
        [&](const tbb::blocked_range<std::int64_t>& r) {
          // Restored on exit, exceptions included, so a failed task cannot leave its thread
          // believing it is still inside a parallel region.
          struct Guard {
            bool outer = in_parallel_region();
            Precision outer_emulation = emulation();
            Fp8Recipe outer_fp8 = fp8_recipe();
            Guard(Precision p, const Fp8Recipe& r) {
              set_in_parallel_region(true);
              set_emulation(p);
              set_fp8_recipe(r);
            }
            ~Guard() {
              set_in_parallel_region(outer);
              set_emulation(outer_emulation);
              set_fp8_recipe(outer_fp8);
            }
          } guard(emulated, fp8);
          for (std::int64_t i = r.begin(); i != r.end(); ++i) body(i);
        },
        tbb::static_partitioner());
  });
}

// Runs body(begin, end) over [0, n) cut into blocks of `grain` indices, in parallel unless the
// reference backend is selected (the oracle stays a plain loop) or the work is one block. The
// body must only write outputs owned by its indices; then the result is the serial loop's, bit
// for bit.
template <class F>
void for_blocks(std::int64_t n, std::int64_t grain, F&& body) {
  if (n <= 0) return;
  grain = std::max<std::int64_t>(1, grain);
  const std::int64_t blocks = (n + grain - 1) / grain;
  if (backend() == Backend::reference || blocks == 1) {
    body(std::int64_t{0}, n);
    return;
  }
  parallel_for_each(blocks, [&](std::int64_t b) { body(b * grain, std::min(n, (b + 1) * grain)); });
}

}  // namespace teo::detail
