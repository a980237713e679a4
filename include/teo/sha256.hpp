// SHA-256 (FIPS 180-4), for the golden manifest's checksums.
#pragma once

#include <string>
#include <string_view>

namespace teo {

// The digest of `bytes` as 64 lowercase hex digits.
std::string sha256_hex(std::string_view bytes);

}  // namespace teo
