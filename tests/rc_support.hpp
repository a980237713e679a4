// rapidcheck helpers the property tests share.
#pragma once

#include <memory>

#include <rapidcheck.h>

#include "teo/backend.hpp"

namespace teo::test {

// One of the three backends, set for the rest of the property (restored by the returned guard)
// and tagged in rapidcheck's report.
inline std::unique_ptr<ScopedSettings> gen_backend() {
  auto keep = std::make_unique<ScopedSettings>();
  const Backend be = *rc::gen::element(Backend::reference, Backend::simd, Backend::blas);
  RC_TAG(to_string(be));
  set_backend(be);
  return keep;
}

}  // namespace teo::test
