// Runs the built `teo` binary with arguments, for the CLI tests: exit code and stdout+stderr.
#pragma once

#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <string>

#include "test_paths.hpp"

namespace teo::test {

struct CliResult {
  int code;
  std::string out;
};

// `s` as one word for /bin/sh, whatever it contains (quotes, spaces, $(...)).
inline std::string shell_quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) {
    if (c == '\'')
      out += "'\\''";
    else
      out += c;
  }
  return out + "'";
}

inline CliResult run_cli(const std::string& args) {
  const std::string cmd = std::string(TEO_TEO_BINARY) + " " + args + " 2>&1";
  FILE* pipe = popen(cmd.c_str(), "r");
  if (!pipe) return {-1, "popen failed"};
  std::string out;
  std::array<char, 4096> buf{};
  while (std::fgets(buf.data(), buf.size(), pipe)) out += buf.data();
  const int status = pclose(pipe);
  return {WEXITSTATUS(status), out};
}

}  // namespace teo::test
