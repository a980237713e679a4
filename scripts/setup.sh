#!/usr/bin/env bash
# Installs every Debian 12 package teo needs to build and run; with --test, also what the test
# suite needs (PyTorch, the second backend the golden corpus is checked against). Idempotent.
set -euo pipefail
packages=(
  build-essential cmake ninja-build git pkg-config
  libxsimd-dev libtbb-dev libopenblas-dev
  nlohmann-json3-dev libcli11-dev
  libgtest-dev librapidcheck-dev libbenchmark-dev
  g++-aarch64-linux-gnu qemu-user
  wamerican wngerman wfrench wspanish witalian gnuplot-nox
)
# Tests: PyTorch (the second backend), clang with libFuzzer for the fuzz harnesses, and
# clang-format and clang-tidy for scripts/lint.sh.
if [ "${1:-}" = "--test" ]; then
  packages+=(python3-torch python3-numpy clang libclang-rt-14-dev clang-format clang-tidy zip unzip)
fi
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
