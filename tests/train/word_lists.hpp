// Five small word lists for the training tests: each language's words carry a telltale suffix.
#pragma once

#include <filesystem>
#include <fstream>
#include <string>

#include <gtest/gtest.h>

#include "teo/train/data.hpp"

namespace teo::test {

// Five small word lists in a fresh directory: each language's words carry a telltale suffix, and
// "shared" and "casa" appear in two lists.
inline std::filesystem::path fake_lists(const std::string& name, int per_language = 60) {
  const std::filesystem::path dir = std::filesystem::path(::testing::TempDir()) / name;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const char* suffix[] = {"ing", "ung", "eau", "ción", "zione"};
  for (std::size_t l = 0; l < teo::train::languages().size(); ++l) {
    std::ofstream out(dir / teo::train::languages()[l].file);
    for (int i = 0; i < per_language; ++i) {
      std::string stem;
      for (int k = i; k > 0 || stem.empty(); k /= 7) stem.push_back(static_cast<char>('a' + k % 7));
      out << stem << suffix[l] << "\n";
    }
    out << "shared\n";
    if (l == 3 || l == 4) out << "casa\n";
  }
  return dir;
}

}  // namespace teo::test
