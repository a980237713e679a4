// Execution settings: which backend computes, on which instruction set, with how many threads.
// They are process-wide; set them before running a model, from one thread, while no teo call is
// running (the CLI does it from its flags, and init_from_environment() from TEO_BACKEND, TEO_ISA
// and TEO_NUM_THREADS). Setting them from inside a teo task throws teo::ConfigError.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace teo {

enum class Backend {
  reference,  // the plain loops: the oracle of the oracle
  simd,       // cache-blocked xsimd kernels, oneTBB-parallel
  blas,       // OpenBLAS sgemm/dgemm for GEMM-shaped work; the simd kernels for the rest
};

enum class Isa { scalar, avx2, avx512, neon };

const char* to_string(Backend b);
const char* to_string(Isa i);
// Parse a name; throw teo::ConfigError naming the flag and the value on an unknown one.
Backend parse_backend(const std::string& name, const std::string& what = "backend");
Isa parse_isa(const std::string& name, const std::string& what = "isa");

// The CPU, as CPUID names it on x86-64 (vendor "GenuineIntel" or "AuthenticAMD", the display
// family and model, the brand string); elsewhere the vendor is the architecture's name and the
// numbers are 0. `teo bench` prints it beside the ISA, and the AVX-512 GEMM takes the cache
// blocking of its vendor (docs/kernels.md, "Blocking per vendor").
struct CpuInfo {
  std::string vendor, brand;
  int family = 0, model = 0, stepping = 0;
  bool intel() const { return vendor == "GenuineIntel"; }
  // "GenuineIntel family 6 model 207 stepping 2 (brand)"
  std::string describe() const;
};
const CpuInfo& cpu_info();

// The kernel set OpenBLAS chose for this CPU ("SkylakeX", "Cooperlake", "Haswell", "Prescott"...):
// what the blas backend runs. OpenBLAS picks it at load time, unless OPENBLAS_CORETYPE names one;
// a release that does not know the CPU falls back to old, slow kernels (docs/performance.md).
std::string openblas_core();

// The instruction sets this binary was built for and this CPU runs, best first; scalar is always
// there.
std::vector<Isa> supported_isas();
Isa best_isa();

void set_backend(Backend b);
Backend backend();
// Throws teo::ConfigError when the ISA is not supported here.
void set_isa(Isa i);
Isa isa();
// 1 to 1024 threads, else teo::ConfigError. The default is the machine's hardware concurrency.
void set_num_threads(int n);
int num_threads();

// Runs task(i) for every i in [0, n), one task per index, on the thread arena (serially on the
// reference backend or with one thread). The kernels a task calls run on its own thread, so n
// independent model passes (the shards of a training batch) keep both cores busy. Each task must
// write only outputs it owns; then the result is the serial loop's, bit for bit, on any thread
// count. An exception from a task is rethrown here.
void parallel_tasks(std::int64_t n, const std::function<void(std::int64_t)>& task);

// Reads TEO_BACKEND, TEO_ISA and TEO_NUM_THREADS when set, and checks TEO_CACHE_MB; throws
// teo::ConfigError naming the variable on a bad value.
void init_from_environment();

// Restores the previous settings on destruction (for tests and scoped runs). The destructor never
// throws: a setting that cannot be restored (from inside a parallel region) stays as it is, with a
// line on standard error.
class ScopedSettings {
 public:
  ScopedSettings();
  ~ScopedSettings() noexcept;
  ScopedSettings(const ScopedSettings&) = delete;
  ScopedSettings& operator=(const ScopedSettings&) = delete;

 private:
  Backend backend_;
  Isa isa_;
  int threads_;
};

}  // namespace teo
