#!/usr/bin/env python3
"""clang-tidy over the given sources, with a verdict cache beside ccache's.

Each source's key is the sha256 of: its preprocessed text (the compile command from the build's
compile_commands.json with -E, the checkout's path replaced by a placeholder so that a clean
clone elsewhere gets the same key), the compile command's flags, every .clang-tidy file of the
checkout, clang-tidy's version and this script's arguments to it. A clean verdict is stored as an
empty file named by the key under CACHE/teo-tidy/; a source whose key is stored is not analysed
again. Findings are never cached: a source with findings is analysed on every run until it is
clean. So a source is re-analysed exactly when anything clang-tidy reads for it (its own text,
any header it includes, a macro, a flag, the checks) has changed.

Usage: scripts/tidy.py BUILD_DIR SOURCE... (from the checkout's root). Prints the findings and
exits 1 when there are any; prints how many sources were analysed and how many were cached.
TEO_TIDY_CACHE=0 analyses every source.
"""
import concurrent.futures
import hashlib
import json
import os
import shlex
import subprocess
import sys

TIDY_ARGS = ["--quiet", "--warnings-as-errors=*"]


def cache_dir():
    base = os.environ.get("CCACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "ccache")
    return os.path.join(base, "teo-tidy")


def preprocess_command(entry):
    """One compile_commands.json entry's command, as clang++ -E to stdout."""
    args = entry.get("arguments") or shlex.split(entry["command"])
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
            continue
        if a in ("-o", "-MF", "-MT", "-MQ"):
            skip = True
            continue
        if a in ("-c", "-MD", "-MMD") or a.startswith("-o"):
            continue
        out.append(a)
    # A compiler launcher (ccache), where the build names one, is not the compiler. The text is
    # clang's (the compiler clang-tidy parses as), so that a __clang__ branch counts too, with the
    # comments kept (-C): NOLINT and argument comments are what some checks read.
    if os.path.basename(out[0]) == "ccache":
        out = out[1:]
    return ["clang++", *out[1:], "-E", "-C", "-Wno-unknown-warning-option"]


def key_of(entry, root, common):
    cmd = preprocess_command(entry)
    text = subprocess.run(cmd, cwd=entry["directory"], check=True, capture_output=True).stdout
    h = hashlib.sha256(common)
    h.update(text.replace(root.encode(), b"@ROOT@"))
    h.update("\0".join(cmd[1:]).replace(root, "@ROOT@").encode())
    return h.hexdigest()


def main():
    build, sources = sys.argv[1], sys.argv[2:]
    root = os.getcwd()
    with open(os.path.join(build, "compile_commands.json")) as f:
        entries = {os.path.realpath(e["file"]): e for e in json.load(f)}
    version = subprocess.run(["clang-tidy", "--version"], check=True, capture_output=True).stdout
    common = hashlib.sha256(version + "\0".join(TIDY_ARGS).encode())
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(("build", ".")))
        if ".clang-tidy" in filenames:
            p = os.path.join(dirpath, ".clang-tidy")
            common.update(os.path.relpath(p, root).encode())
            with open(p, "rb") as f:
                common.update(f.read())
    common = common.digest()
    use_cache = os.environ.get("TEO_TIDY_CACHE", "1") != "0"
    cache = cache_dir()
    os.makedirs(cache, exist_ok=True)

    def run(src):
        entry = entries.get(os.path.realpath(src))
        if entry is None:
            return src, None, f"{src}: not in {build}/compile_commands.json\n"
        key = key_of(entry, root, common)
        stamp = os.path.join(cache, key)
        if use_cache and os.path.exists(stamp):
            return src, True, ""
        r = subprocess.run(["clang-tidy", "-p", build, *TIDY_ARGS, src], capture_output=True,
                           text=True)
        if r.returncode == 0:
            tmp = f"{stamp}.{os.getpid()}"
            open(tmp, "w").close()
            os.replace(tmp, stamp)
            return src, False, ""
        return src, None, r.stdout + r.stderr

    jobs = os.cpu_count() or 1
    cached = analysed = 0
    failed = []
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        for src, hit, text in pool.map(run, sources):
            if hit is None:
                failed.append((src, text))
            elif hit:
                cached += 1
            else:
                analysed += 1
    for src, text in failed:
        lines = [l for l in text.splitlines() if "warning:" in l or "error:" in l]
        print("\n".join(lines[:40]) if lines else text[-4000:])
    print(f"clang-tidy: {len(sources)} sources: {analysed} analysed, {cached} clean in the cache "
          f"({cache}), {len(failed)} with findings")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
