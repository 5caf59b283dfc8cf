"""Finds 16-byte stores that the compiler split into four 32-bit ones in PTX
files (nvcc -keep): st.global of 4 bytes at [%rdN], [%rdN+4], [%rdN+8] and
[%rdN+12]. Each kernel's global stores are meant to be single 16-byte ones
(store_pack, csrc/common/cuda_utils.cuh); NVVM split some where they were
C++ assignments (docs/perf-notes.md, v15). Exit status 1 on any split store
outside ALLOWED, with the kernel named.

    python tools/ci/ptx_stores.py FILE.ptx ..."""
import re
import subprocess
import sys

# Kernels allowed to keep split stores (demangled-name substrings), and why.
ALLOWED = {
    "fwd_loop<float, float, float, 4>":
        "fp32 rows keep C++ assignments: with inline-PTX stores it spilled (norm_wide.cuh, fwd_loop)",
}

STORE = re.compile(r"st\.global\.(?:u32|b32|s32|f32)\s+\[(%rd\d+)(?:\+(\d+))?\]")


def split_stores(ptx):
    """(kernel, count) for each kernel of `ptx` with split 16-byte stores."""
    out = []
    for entry in re.split(r"\n(?=(?:\.visible\s+|\.weak\s+)?\.entry )", ptx)[1:]:
        name = re.search(r"\.entry\s+(\S+?)\(", entry).group(1)
        seen, n = {}, 0
        for m in STORE.finditer(entry):
            off = int(m.group(2) or 0)
            offs = seen.setdefault(m.group(1), set())
            offs.add(off)
            if off == 12 and {0, 4, 8} <= offs:
                n += 1
                offs.clear()
        if n:
            out.append((name, n))
    return out


def demangle(names):
    if not names:
        return []
    try:
        r = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, check=True)
        return r.stdout.split("\n")[:len(names)]
    except (OSError, subprocess.CalledProcessError):
        return names


def main(paths):
    bad = 0
    for path in paths:
        found = split_stores(open(path).read())
        for (_, n), name in zip(found, demangle([k for k, _ in found])):
            why = next((w for k, w in ALLOWED.items() if k in name), None)
            if why:
                print(f"ptx_stores: {path}: {name}: {n} split 16-byte stores (allowed: {why})")
            else:
                print(f"ptx_stores: {path}: {name}: {n} 16-byte stores split into 32-bit ones", file=sys.stderr)
                bad += 1
    print(f"ptx_stores: {len(paths)} PTX files, {bad} kernels with split stores")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
