#!/usr/bin/env bash
# Installs every Debian 12 package teo needs to build and run (ccache among them, which the build
# scripts compile through: scripts/cache.sh); with --test, also what the test
# suite needs (PyTorch, the second backend the golden corpus is checked against). With --test or
# --python it also makes the virtual environment .venv for the Python module (`pip install .`):
# on Debian's /usr/bin/python3 with --system-site-packages, so that Debian's numpy and PyTorch
# stay the ones it uses, plus ml_dtypes (and, with --test, transformers) from the index. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
packages=(
  build-essential cmake ninja-build git pkg-config ccache
  libxsimd-dev libtbb-dev libopenblas-dev
  python3-dev pybind11-dev python3-numpy python3-venv
  nlohmann-json3-dev libcli11-dev
  libgtest-dev librapidcheck-dev libbenchmark-dev
  g++-aarch64-linux-gnu qemu-user
  wamerican wngerman wfrench wspanish witalian gnuplot-nox
)
# Tests: PyTorch (the second backend), clang with libFuzzer for the fuzz harnesses, and
# clang-format and clang-tidy for scripts/lint.sh.
if [ "${1:-}" = "--test" ]; then
  packages+=(python3-torch python3-pytest clang libclang-rt-14-dev clang-format clang-tidy zip unzip)
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

# The virtual environment. ml_dtypes 0.5 and later need numpy 2, which Debian's PyTorch 1.13 cannot
# load; 0.4 works with Debian's numpy 1.24.
if [ "${1:-}" = "--test" ] || [ "${1:-}" = "--python" ]; then
  if [ ! -x .venv/bin/python ]; then
    /usr/bin/python3 -m venv --system-site-packages .venv
  fi
  .venv/bin/python -c "import ml_dtypes" 2>/dev/null ||
    .venv/bin/python -m pip install -q "ml_dtypes>=0.2,<0.5"
fi
# The tests' GGUF reader (tests/interop/gguf_blocks.py): llama.cpp's own Python package, pinned.
if [ "${1:-}" = "--test" ]; then
  .venv/bin/python -m pip show gguf 2>/dev/null | grep -qx 'Version: 0.19.0' ||
    .venv/bin/python -m pip install -q "gguf==0.19.0"
fi
# The tests' Hugging Face models (tests/interop/hf_models.py): a transformers release that runs on
# Debian's PyTorch 1.13, pinned so that the test does not change under it.
if [ "${1:-}" = "--test" ]; then
  .venv/bin/python -c "import transformers" 2>/dev/null ||
    .venv/bin/python -m pip install -q "transformers==4.44.2"
fi
