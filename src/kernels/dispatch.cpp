// The execution settings and the only place that knows every ISA.
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#endif

#include <tbb/global_control.h>

#include "kernels_internal.hpp"
#include "parallel.hpp"
#include "teo/errors.hpp"
#include "teo/precision.hpp"
#include "teo/tensor.hpp"

namespace teo {

namespace detail {
void blas_set_threads(int n);
}

namespace {

struct Settings {
  Backend backend = Backend::reference;
  Isa isa = Isa::scalar;
  int threads = 1;
  // TBB caps its workers at the core count unless told otherwise; the cap is lifted so that a
  // thread count above the core count (7 on 2 cores, in the determinism tests) is real.
  std::unique_ptr<tbb::global_control> limit;
  std::unique_ptr<tbb::task_arena> arena;
  std::once_flag init;
};

Settings& settings() {
  static Settings s;
  std::call_once(s.init, [] {
    s.isa = best_isa();
    s.threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    s.limit = std::make_unique<tbb::global_control>(tbb::global_control::max_allowed_parallelism,
                                                    static_cast<std::size_t>(s.threads));
    s.arena = std::make_unique<tbb::task_arena>(s.threads);
    detail::blas_set_threads(1);
  });
  return s;
}

}  // namespace

const char* to_string(Backend b) {
  switch (b) {
    case Backend::reference:
      return "reference";
    case Backend::simd:
      return "simd";
    case Backend::blas:
      return "blas";
  }
  return "?";
}

const char* to_string(Isa i) {
  switch (i) {
    case Isa::scalar:
      return "scalar";
    case Isa::avx2:
      return "avx2";
    case Isa::avx512:
      return "avx512";
    case Isa::neon:
      return "neon";
  }
  return "?";
}

Backend parse_backend(const std::string& name, const std::string& what) {
  for (Backend b : {Backend::reference, Backend::simd, Backend::blas})
    if (name == to_string(b)) return b;
  throw ConfigError(what + " must be reference, simd or blas, got \"" + name + "\"");
}

Isa parse_isa(const std::string& name, const std::string& what) {
  for (Isa i : {Isa::scalar, Isa::avx2, Isa::avx512, Isa::neon})
    if (name == to_string(i)) return i;
  throw ConfigError(what + " must be avx512, avx2, neon or scalar, got \"" + name + "\"");
}

std::vector<Isa> supported_isas() {
  std::vector<Isa> out;
#if defined(__x86_64__) || defined(_M_X64)
  // libgcc's CPU model checks both CPUID and that the OS saves the AVX / AVX-512 state (XCR0),
  // and every extension the ISA's translation unit is compiled with must be there.
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") &&
                      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl");
  if (avx512) out.push_back(Isa::avx512);
  if (avx2) out.push_back(Isa::avx2);
#endif
#if defined(__aarch64__)
  out.push_back(Isa::neon);
#endif
  out.push_back(Isa::scalar);
  return out;
}

const CpuInfo& cpu_info() {
  static const CpuInfo info = [] {
    CpuInfo c;
#if defined(__x86_64__) || defined(_M_X64)
    unsigned a = 0, b = 0, cx = 0, d = 0;
    if (__get_cpuid(0, &a, &b, &cx, &d)) {
      char v[13] = {};
      std::memcpy(v, &b, 4);
      std::memcpy(v + 4, &d, 4);
      std::memcpy(v + 8, &cx, 4);
      c.vendor = v;
    }
    if (__get_cpuid(1, &a, &b, &cx, &d)) {
      // The display family and model: the extended fields count for family 15 (and, for the
      // model, family 6) as the vendors' manuals define.
      const int base_family = static_cast<int>((a >> 8) & 0xf);
      const int base_model = static_cast<int>((a >> 4) & 0xf);
      c.family =
          base_family == 0xf ? base_family + static_cast<int>((a >> 20) & 0xff) : base_family;
      c.model = base_family == 0x6 || base_family == 0xf
                    ? base_model + (static_cast<int>((a >> 16) & 0xf) << 4)
                    : base_model;
      c.stepping = static_cast<int>(a & 0xf);
    }
    if (__get_cpuid(0x80000000, &a, &b, &cx, &d) && a >= 0x80000004) {
      char brand[49] = {};
      for (std::size_t leaf = 0; leaf < 3; ++leaf) {
        __get_cpuid(0x80000002 + static_cast<unsigned>(leaf), &a, &b, &cx, &d);
        char* at = brand + std::size_t{16} * leaf;
        std::memcpy(at, &a, 4);
        std::memcpy(at + 4, &b, 4);
        std::memcpy(at + 8, &cx, 4);
        std::memcpy(at + 12, &d, 4);
      }
      c.brand = brand;
      const auto first = c.brand.find_first_not_of(' ');
      c.brand = first == std::string::npos ? "" : c.brand.substr(first);
      while (!c.brand.empty() && c.brand.back() == ' ') c.brand.pop_back();
    }
#elif defined(__aarch64__)
    c.vendor = "aarch64";
#else
    c.vendor = "unknown";
#endif
    if (c.vendor.empty()) c.vendor = "unknown";
    return c;
  }();
  return info;
}

std::string CpuInfo::describe() const {
  std::string s = vendor;
  if (family != 0 || model != 0)
    s += " family " + std::to_string(family) + " model " + std::to_string(model) + " stepping " +
         std::to_string(stepping);
  if (!brand.empty()) s += " (" + brand + ")";
  return s;
}

Isa best_isa() {
  return supported_isas().front();
}

namespace {
// The settings are read by every task; changing them while tasks run would race with them (and
// set_num_threads replaces the arena they run in).
void require_outside_parallel_region(const char* what) {
  if (detail::in_parallel_region()) {
    throw ConfigError(std::string(what) + " cannot be called from inside a teo parallel region");
  }
}
}  // namespace

void set_backend(Backend b) {
  require_outside_parallel_region("set_backend");
  settings().backend = b;
}
Backend backend() {
  return settings().backend;
}

void set_isa(Isa i) {
  const auto ok = supported_isas();
  if (std::find(ok.begin(), ok.end(), i) == ok.end()) {
    std::string list;
    for (Isa s : ok) list += std::string(list.empty() ? "" : ", ") + to_string(s);
    throw ConfigError(std::string("isa \"") + to_string(i) +
                      "\" is not supported on this machine (supported: " + list + ")");
  }
  require_outside_parallel_region("set_isa");
  settings().isa = i;
}
Isa isa() {
  return settings().isa;
}

void set_num_threads(int n) {
  if (n < 1 || n > 1024) {
    throw ConfigError("threads must be in [1, 1024], got " + std::to_string(n));
  }
  require_outside_parallel_region("set_num_threads");
  Settings& s = settings();
  if (n == s.threads) return;
  s.threads = n;
  s.arena.reset();
  s.limit = std::make_unique<tbb::global_control>(tbb::global_control::max_allowed_parallelism,
                                                  static_cast<std::size_t>(n));
  s.arena = std::make_unique<tbb::task_arena>(n);
}
int num_threads() {
  return settings().threads;
}

void init_from_environment() {
  memory::check_environment();
  if (const char* v = std::getenv("TEO_BACKEND"); v && *v)
    set_backend(parse_backend(v, "TEO_BACKEND"));
  if (const char* v = std::getenv("TEO_ISA"); v && *v) set_isa(parse_isa(v, "TEO_ISA"));
  if (const char* v = std::getenv("TEO_NUM_THREADS"); v && *v) {
    char* end = nullptr;
    const long n = std::strtol(v, &end, 10);
    if (*end != '\0' || n < 1 || n > 1024) {
      throw ConfigError(std::string("TEO_NUM_THREADS must be an integer in [1, 1024], got \"") + v +
                        "\"");
    }
    set_num_threads(static_cast<int>(n));
  }
}

void parallel_tasks(std::int64_t n, const std::function<void(std::int64_t)>& task) {
  if (backend() == Backend::reference) {
    for (std::int64_t i = 0; i < n; ++i) task(i);
    return;
  }
  detail::parallel_for_each(n, task);
}

ScopedSettings::ScopedSettings() : backend_(backend()), isa_(isa()), threads_(num_threads()) {}
ScopedSettings::~ScopedSettings() noexcept {
  // A destructor must not throw (that would be std::terminate). The values restored were valid
  // when read, so a restore fails only inside a parallel region, where the setters refuse to run,
  // or when the new arena cannot be allocated; the setting is then left as it is, and said so.
  const auto restore = [](const char* what, const auto& set) {
    try {
      set();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "teo: %s not restored: %s\n", what, e.what());
    }
  };
  restore("backend", [&] { set_backend(backend_); });
  restore("isa", [&] { set_isa(isa_); });
  restore("threads", [&] { set_num_threads(threads_); });
}

namespace detail {

tbb::task_arena& arena() {
  return *settings().arena;
}

namespace {
thread_local bool tl_in_parallel_region = false;
}
bool in_parallel_region() {
  return tl_in_parallel_region;
}
void set_in_parallel_region(bool v) {
  tl_in_parallel_region = v;
}

namespace {
thread_local Precision tl_emulation = Precision::fp32;
thread_local Fp8Recipe tl_fp8;
}  // namespace
Precision emulation() {
  return tl_emulation;
}
void set_emulation(Precision p) {
  tl_emulation = p;
}
const Fp8Recipe& fp8_recipe() {
  return tl_fp8;
}
void set_fp8_recipe(const Fp8Recipe& r) {
  tl_fp8 = r;
}

const simd::IsaKernels& isa_kernels(Isa i) {
  switch (i) {
#if defined(__x86_64__) || defined(_M_X64)
    case Isa::avx512: {
      // Read once: every GEMM and attention row asks for its table.
      static const simd::IsaKernels& table = simd::kernels_avx512(
          cpu_info().intel() ? simd::CpuVendor::intel : simd::CpuVendor::other);
      return table;
    }
    case Isa::avx2:
      return simd::kernels_avx2();
#endif
#if defined(__aarch64__)
    case Isa::neon:
      return simd::kernels_neon();
#endif
    default:
      return simd::kernels_scalar();
  }
}

const simd::IsaKernels& isa_kernels() {
  return isa_kernels(isa());
}

template <>
const simd::VectorKernels<float>& vector_kernels<float>() {
  return isa_kernels().svec;
}
template <>
const simd::VectorKernels<double>& vector_kernels<double>() {
  return isa_kernels().dvec;
}

}  // namespace detail

namespace {

// The (rows, cols) matrix at src with leading dimension ld, copied densely into dst and rounded to
// p: an emulated product's operand.
void rounded_operand(std::vector<float>& dst, const float* src, index_t rows, index_t cols,
                     index_t ld, Precision p) {
  p = storage_format(p);
  dst.resize(static_cast<std::size_t>(rows * cols));
  const auto& round = detail::isa_kernels().rounding.round;
  float* out = dst.data();
  std::atomic<bool> over{false};
  detail::for_blocks(rows, std::max<index_t>(1, 16384 / std::max<index_t>(1, cols)),
                     [&](index_t r0, index_t r1) {
                       for (index_t r = r0; r < r1; ++r)
                         if (round(out + r * cols, src + r * ld, cols, p)) over = true;
                     });
  // Every stored operand was rounded, and checked, by name where it was produced; this is the
  // backstop for any other.
  if (over) throw RangeError("a matrix product's operand: " + overflow_message(p));
}

}  // namespace

template <class Real>
void gemm(Trans ta, Trans tb, index_t m, index_t n, index_t k, Real alpha, const Real* a,
          index_t lda, const Real* b, index_t ldb, Real beta, Real* c, index_t ldc) {
  if constexpr (std::is_same_v<Real, float>) {
    // Under emulation, the product reads its operands rounded to the format (for tf32, to tf32's
    // 10 mantissa bits) and accumulates in float, as the hardware does.
    if (const Precision p = detail::emulation(); p != Precision::fp32 && m > 0 && n > 0 && k > 0) {
      // The rounded copies live in this thread's buffers, reused from product to product (the
      // attention heads' small products would otherwise allocate twice each); a product that
      // starts while they are in use on this thread gets buffers of its own.
      struct Buffers {
        std::vector<float> a, b;
        bool busy = false;
      };
      thread_local Buffers mine;
      Buffers own;
      Buffers& buf = mine.busy ? own : mine;
      struct Hold {
        Buffers& b;
        explicit Hold(Buffers& x) : b(x) { b.busy = true; }
        ~Hold() { b.busy = false; }
      } hold(buf);
      std::vector<float>& ar = buf.a;
      std::vector<float>& br = buf.b;
      const bool at = ta == Trans::yes, bt = tb == Trans::yes;
      rounded_operand(ar, a, at ? k : m, at ? m : k, lda, p);
      rounded_operand(br, b, bt ? n : k, bt ? k : n, ldb, p);
      const detail::EmulationScope plain(Precision::fp32);
      return gemm<float>(ta, tb, m, n, k, alpha, ar.data(), at ? m : k, br.data(), bt ? k : n, beta,
                         c, ldc);
    }
  }
  switch (backend()) {
    case Backend::reference:
      return detail::reference_gemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    case Backend::blas:
      return detail::blas_gemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    case Backend::simd:
      return detail::simd_gemm(detail::gemm_tile<Real>(detail::isa_kernels(), m, n), ta, tb, m, n,
                               k, alpha, a, lda, b, ldb, beta, c, ldc);
  }
}

template void gemm<float>(Trans, Trans, index_t, index_t, index_t, float, const float*, index_t,
                          const float*, index_t, float, float*, index_t);
template void gemm<double>(Trans, Trans, index_t, index_t, index_t, double, const double*, index_t,
                           const double*, index_t, double, double*, index_t);

}  // namespace teo
