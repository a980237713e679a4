// The paths the tests read: the source tree (TEO_SOURCE_DIR) and the teo executable
// (TEO_TEO_BINARY). They are defined in one unit that tests/CMakeLists.txt generates, not on every
// unit's command line, so that the tests' objects do not depend on where the checkout is and
// ccache shares them between checkouts (a clean clone compiles only that one unit again).
#pragma once

namespace teo::test {
extern const char* const kSourceDir;
extern const char* const kTeoBinary;
}  // namespace teo::test

#define TEO_SOURCE_DIR ::teo::test::kSourceDir
#define TEO_TEO_BINARY ::teo::test::kTeoBinary
