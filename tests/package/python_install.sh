#!/usr/bin/env bash
# `pip wheel .` from a clean copy of the tree (the tracked files only), and the wheel installed
# into a fresh virtual environment made as scripts/setup.sh makes .venv; then, outside the tree, the installed module
# is imported and checks a golden case and an op case.
# Usage: tests/package/python_install.sh WORK_DIR
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
work=$1
rm -rf "$work"
mkdir -p "$work/src"
if git -C "$root" rev-parse --git-dir > /dev/null 2>&1; then
  git -C "$root" ls-files -z | (cd "$root" && xargs -0 cp --parents -t "$work/src")
else
  (cd "$root" && tar --exclude='./build*' --exclude='./.venv' -cf - .) | tar -xf - -C "$work/src"
fi
/usr/bin/python3 -m venv --system-site-packages "$work/venv"
# As scripts/setup.sh: the ml_dtypes that works with Debian's numpy.
"$work/venv/bin/python" -m pip install -q "ml_dtypes>=0.2,<0.5"
# `pip wheel` builds the wheel (scikit-build-core and pybind11 come from the index into pip's
# build environment); installing that wheel is what `pip install .` does in one step.
# The compiles go through ccache where scripts/cache.sh finds it (CMake reads the launcher from the
# environment), with the build folder at the copy's build/ and paths hashed relative to the copy:
# the same relative paths and, with TEO_WERROR as scripts/build.sh sets it, the same flags as the
# Release tree, so that the library's objects are the cache's entries from that build and only
# the module itself and the links are new. ccache hashes the compiler's name too, and
# scikit-build-core would otherwise name Python's (x86_64-linux-gnu-g++), so CXX is the one CMake
# picks for the Release tree. The wheel is the one `pip install .` builds.
source "$root/scripts/cache.sh"
settings=()
if ((${#ccache_launcher[@]})); then
  export CMAKE_CXX_COMPILER_LAUNCHER=ccache CCACHE_BASEDIR="$work/src" CXX="${CXX:-c++}"
  settings=(--config-settings=build-dir="$work/src/build"
            --config-settings=cmake.define.TEO_WERROR=ON)
fi
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
"$work/venv/bin/python" -m pip wheel -q --no-deps "${settings[@]}" -w "$work/wheels" "$work/src"
"$work/venv/bin/python" -m pip install -q "$work"/wheels/teo-*.whl
cd "$work"
"$work/venv/bin/python" - "$root/golden" <<'PY'
import os, sys
import numpy as np
import teo
golden = sys.argv[1]
assert teo.__file__.startswith(sys.prefix), teo.__file__
case = os.path.join(golden, "post_gelu_mean_f64.safetensors")
g = teo.golden.load(case)
params = {n[6:]: a for n, a in g.tensors.items() if n.startswith("param.")}
batch = {k: g.tensors["input." + k] for k in ("tokens", "lengths", "labels")}
out = teo.run(g.config, params, batch, train=True, dropout_seed=g.case["seed"])
report = teo.golden.check(case, out, require_all=True)
print(report.text.splitlines()[-1])
assert report.passed, str(report)
op = teo.golden.load(os.path.join(golden, "ops", "attention_bf16.safetensors"))
cand = {n: a.astype(np.float32) for n, a in op.tensors.items() if n.startswith(("output.", "grad.input."))}
import ml_dtypes
cand = {n: a.astype(ml_dtypes.bfloat16) for n, a in cand.items()}
r = teo.golden.check(op, cand)
assert r.passed and r.precision == "bf16", str(r)
print("installed teo", teo.__version__, "at", os.path.dirname(teo.__file__), "passes")
PY
