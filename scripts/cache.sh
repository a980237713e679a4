# Sourced by the build scripts: compile through ccache (Debian's `ccache`, which scripts/setup.sh
# installs) so that the Release tree, the sanitizer tree and the pip wheel reuse what an earlier
# build of the same sources compiled, in this checkout or in another one on the same machine.
# Paths under the checkout are hashed relative to it (CCACHE_BASEDIR) and the build directory is
# left out of the hash (CCACHE_NOHASHDIR), so a clean clone elsewhere hits the same entries; a
# machine that has never built only misses. TEO_CCACHE=0 turns it off.
# Sets: ccache_launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache) or (), and exports the cache's
# settings for everything started from the caller (ctest's pip test among them).
ccache_launcher=()
if [ "${TEO_CCACHE:-1}" != 0 ] && command -v ccache >/dev/null; then
  export CCACHE_DIR="${CCACHE_DIR:-$HOME/.cache/ccache}"
  export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)}"
  export CCACHE_NOHASHDIR=1
  export CCACHE_MAXSIZE="${CCACHE_MAXSIZE:-8G}"
  ccache_launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
fi
