#!/bin/bash -eu
# Builds teo's five libFuzzer harnesses the way ClusterFuzzLite and OSS-Fuzz expect, from the
# variables they set: CC, CXX, CFLAGS, CXXFLAGS (the sanitizer, with -fsanitize=fuzzer-no-link),
# LIB_FUZZING_ENGINE (how to link the engine), SRC, WORK and OUT. Into $OUT it writes
# teo_fuzz_<harness>, teo_fuzz_<harness>_seed_corpus.zip, teo_fuzz_<harness>.dict, the golden file
# the golden_check harness compares against, and lib/ with the shared libraries the harnesses load
# (found through their RUNPATH $ORIGIN/lib, so that the runner image needs none installed).
# Runs as is outside a container too: tests/fuzz/clusterfuzzlite_build.sh does that in ctest.
here="$(cd "$(dirname "$0")" && pwd)"
if [ -n "${TEO_ROOT:-}" ]; then
  root="$TEO_ROOT"
elif [ -f "$here/../CMakeLists.txt" ] && [ -d "$here/../fuzz" ]; then
  root="$(cd "$here/.." && pwd)"  # run from the repository's .clusterfuzzlite/
else
  root="$SRC/teo"  # the engines' container: the Dockerfile copies the repository there
fi
: "${WORK:?WORK must be set}" "${OUT:?OUT must be set}"
harnesses=(safetensors config shape golden_check op_spec gguf)
generator=()
if command -v ninja >/dev/null; then generator=(-G Ninja); fi
# Build type "Engine": no flags of its own, only the engine's CFLAGS and CXXFLAGS.
cmake -S "$root" -B "$WORK/teo-build" "${generator[@]}" \
  -DCMAKE_BUILD_TYPE=Engine \
  -DCMAKE_C_COMPILER="$CC" -DCMAKE_CXX_COMPILER="$CXX" \
  -DCMAKE_C_FLAGS="$CFLAGS" -DCMAKE_CXX_FLAGS="$CXXFLAGS" \
  -DTEO_FUZZ=ON -DTEO_OWN_SANITIZERS=OFF -DTEO_FUZZ_ENGINE="$LIB_FUZZING_ENGINE" \
  -DTEO_BUILD_TESTS=OFF -DTEO_BUILD_BENCH=OFF -DTEO_BUILD_PYTHON=OFF \
  -DCMAKE_BUILD_RPATH='$ORIGIN/lib'
cmake --build "$WORK/teo-build" --target "${harnesses[@]/#/teo_fuzz_}"
mkdir -p "$OUT/lib"
for h in "${harnesses[@]}"; do
  exe="$WORK/teo-build/fuzz/teo_fuzz_$h"
  cp "$exe" "$OUT/"
  rm -f "$OUT/teo_fuzz_${h}_seed_corpus.zip"
  (cd "$root/fuzz/corpus/$h" && zip -q -r "$OUT/teo_fuzz_${h}_seed_corpus.zip" .)
  dict=config.dict
  if [ "$h" = safetensors ] || [ "$h" = golden_check ]; then dict=safetensors.dict; fi
  if [ "$h" = op_spec ]; then dict=op_spec.dict; fi
  if [ "$h" = gguf ]; then dict=gguf.dict; fi
  cp "$root/fuzz/$dict" "$OUT/teo_fuzz_$h.dict"
  # The shared libraries outside the base system (TBB, OpenBLAS and what they need).
  ldd "$exe" | awk '/=> \// {print $3}' | grep -E 'libtbb|libopenblas|libgfortran|libquadmath' |
    while read -r lib; do cp -L "$lib" "$OUT/lib/"; done
done
cp "$root/golden/post_gelu_mean_f32.safetensors" "$OUT/teo_fuzz_golden_check.golden.safetensors"
echo "build.sh: ${#harnesses[@]} fuzzers, seed corpora and dictionaries in $OUT"
