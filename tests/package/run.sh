#!/usr/bin/env bash
# Installs the built teo into a fresh prefix, then builds and runs tests/package/consumer.cpp
# twice: as a CMake project (find_package(teo), teo::teo) and with pkg-config alone. Both must
# run and print the same line; `teo --version`, the CMake version file and teo.pc must agree.
# Usage: tests/package/run.sh BUILD_DIR WORK_DIR
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
build="$1"
work="$2"
rm -rf "$work"
mkdir -p "$work"
prefix="$work/prefix"
cmake --install "$build" --prefix "$prefix" > "$work/install.log"
test -x "$prefix/bin/teo"

generator=()
if command -v ninja >/dev/null; then generator=(-G Ninja); fi
cmake -S "$here" -B "$work/cmake" "${generator[@]}" -DCMAKE_PREFIX_PATH="$prefix" \
  -DCMAKE_BUILD_TYPE=Release > "$work/configure.log"
cmake --build "$work/cmake" > "$work/build.log"
from_cmake=$("$work/cmake/consumer")

PKG_CONFIG_PATH="$(dirname "$(find "$prefix" -name teo.pc -print -quit)")"
export PKG_CONFIG_PATH
cmake_version=$(grep -m 1 -o 'PACKAGE_VERSION "[^"]*"' \
  "$(find "$prefix" -name teoConfigVersion.cmake -print -quit)" | cut -d'"' -f2)
if [ "$(pkg-config --modversion teo)" != "$cmake_version" ] ||
   [ "$("$prefix/bin/teo" --version)" != "teo $cmake_version" ]; then
  echo "package: versions disagree: teo.pc $(pkg-config --modversion teo)," \
       "CMake $cmake_version, $("$prefix/bin/teo" --version)" >&2
  exit 1
fi
# shellcheck disable=SC2046
c++ -O2 -o "$work/consumer_pc" "$here/consumer.cpp" $(pkg-config --cflags --libs teo)
from_pc=$("$work/consumer_pc")

echo "find_package: $from_cmake"
echo "pkg-config:   $from_pc"
if [ "$from_cmake" != "$from_pc" ]; then
  echo "package: the two builds print different results" >&2
  exit 1
fi
echo "package: installed teo $(pkg-config --modversion teo) builds and runs a consumer both ways"
