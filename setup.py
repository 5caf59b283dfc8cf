"""Build fusedops._C: C kernels (C11 + OpenMP), CUDA C kernels and the thin
C++ registration shim, as one abi3 extension against torch's stable ABI.

Switches (environment):
  FUSEDOPS_CUDA=0|1       force a CPU-only build / require CUDA (default: build CUDA
                          kernels when torch has CUDA and nvcc is found)
  TORCH_CUDA_ARCH_LIST    GPU targets (default "8.0;9.0")
  CUDA_HOME               the toolkit (default: that of the nvcc on PATH, locate_cuda_home)
  MAX_JOBS                parallel compile jobs
"""
import glob
import os
import platform
import re
import shlex
import subprocess
import sys
import sysconfig

import setuptools
from setuptools import setup

# pyproject.toml's license is an SPDX expression (PEP 639), which setuptools
# reads from 77 on; an older one fails on it with a schema error that names
# neither the version nor the fix. (--no-build-isolation builds with the
# setuptools installed, whatever build-system.requires says.)
if int(re.match(r"\d+", setuptools.__version__)[0]) < 77:
    sys.exit(f"fusedops: building needs setuptools 77 or later, found {setuptools.__version__}: "
             "pip install -U setuptools")


def locate_cuda_home():
    """Sets CUDA_HOME to the toolkit of the nvcc on PATH, unless CUDA_HOME or
    CUDA_PATH is set. torch's build helpers otherwise take the directory above
    nvcc's: where nvcc on PATH is a wrapper script (/usr/local/bin/nvcc that
    runs /usr/local/cuda-13.0/bin/nvcc) that is /usr/local, which has no
    lib64/libcudart, and the link fails. nvcc -dryrun names its own bin
    directory (_HERE_)."""
    if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or os.environ.get("FUSEDOPS_CUDA") == "0":
        return
    try:
        err = subprocess.run(["nvcc", "-dryrun", "-E", "-x", "cu", os.devnull], capture_output=True, text=True,
                             timeout=120).stderr
    except (OSError, subprocess.SubprocessError):
        return  # no nvcc on PATH: torch's own search decides
    here = re.search(r"^#\$ _HERE_=(.+)$", err, re.M)
    if here:
        os.environ["CUDA_HOME"] = os.path.dirname(os.path.abspath(here[1].strip()))


locate_cuda_home()

import torch  # noqa: E402  (after CUDA_HOME: torch.utils.cpp_extension reads it on import)
from torch.utils import cpp_extension  # noqa: E402

TORCH_TARGET = "0x020B000000000000"  # torch 2.11: the oldest release the binary serves
HERE = os.path.dirname(os.path.abspath(__file__))
VERSION = re.search(r'__version__ = "([^"]+)"', open(os.path.join(HERE, "fusedops/__init__.py")).read())[1]


def want_cuda():
    flag = os.environ.get("FUSEDOPS_CUDA", "")
    have = torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None
    if flag == "0":
        return False
    if flag == "1" and not have:
        sys.exit("FUSEDOPS_CUDA=1 but CUDA is unavailable: torch %s (CUDA %s), CUDA_HOME=%s"
                 % (torch.__version__, torch.version.cuda, cpp_extension.CUDA_HOME))
    return have


WITH_CUDA = want_cuda()
# 9.0 is built as 9.0a: the wgmma attention kernels need the arch-specific
# target, and every 9.0 GPU (H100, H200, GH200) runs its code.
ARCHS = ";".join(re.sub(r"^9\.0(?!a)", "9.0a", a) for a in
                 re.split(r"[;\s]+", os.environ.get("TORCH_CUDA_ARCH_LIST", "8.0;9.0").strip())) if WITH_CUDA else ""
if WITH_CUDA:
    os.environ["TORCH_CUDA_ARCH_LIST"] = ARCHS
DEFINES = [f"-DTORCH_TARGET_VERSION={TORCH_TARGET}"] + (["-DFUSEDOPS_WITH_CUDA", "-DUSE_CUDA"] if WITH_CUDA else [])


# The CPU kernels are compiled once per x86-64 level (csrc/common/cpu_dtype.h):
# FO_LEVEL, and the flags of that level's copy. Off x86-64, the baseline only.
if platform.machine().lower() in ("x86_64", "amd64"):
    CPU_LEVELS = {0: [], 3: ["-march=x86-64-v3"], 4: ["-march=x86-64-v4", "-mprefer-vector-width=512"]}
else:
    CPU_LEVELS = {0: []}


class BuildExt(cpp_extension.BuildExtension):
    """torch's BuildExtension compiles every non-CUDA file as C++; the C sources
    are compiled here with the C compiler first, once per CPU level, and linked
    in as objects."""

    def build_extension(self, ext):
        cc = shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")
        c_sources = [s for s in ext.sources if s.endswith(".c")]
        ext.sources = [s for s in ext.sources if not s.endswith(".c")]
        macros = [f"-DFUSEDOPS_CUDA_ARCHS={ARCHS}", f"-DFUSEDOPS_TORCH_TARGET={TORCH_TARGET}",
                  f"-DFUSEDOPS_BUILT_WITH_TORCH={torch.__version__}"]
        for src in c_sources:
            # module.c is not a kernel: one copy
            for level, flags in (CPU_LEVELS.items() if src.endswith("_cpu.c") else [(0, [])]):
                obj = os.path.join(self.build_temp, "c", f"{src.replace('/', '_')}.v{level}.o")
                os.makedirs(os.path.dirname(obj), exist_ok=True)
                # -fno-trapping-math: no kernel reads the FP exception flags, and
                # without it GCC will not if-convert the clamps of a vectorised exp.
                # -fno-math-errno: sqrtf may then vectorise (no kernel reads errno).
                cmd = cc + ["-std=c11", "-O3", "-fno-trapping-math", "-fno-math-errno", "-fPIC", "-fopenmp", "-Wall",
                            "-Wextra", "-Werror", "-Wno-psabi", *flags, f"-DFO_LEVEL={level}",
                            f"-DFO_X86_LEVELS={int(len(CPU_LEVELS) > 1)}",
                            "-I" + sysconfig.get_paths()["include"], *DEFINES,
                            *[f'-D{m[2:].split("=")[0]}="{m.split("=", 1)[1]}"' for m in macros],
                            "-c", src, "-o", obj]
                print(" ".join(cmd), flush=True)
                subprocess.check_call(cmd)
                ext.extra_objects.append(obj)
        super().build_extension(ext)


def extension():
    sources = sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/*/*_ops.cpp") + ["csrc/module.c"]
                     + glob.glob("csrc/*/*_cpu.c") + glob.glob("csrc/*/*_plan.c") + ["csrc/common/tune.c"])
    cxx = ["-O3", "-std=c++17", "-Wall", *DEFINES]
    link = ["-fopenmp"]
    if sys.platform.startswith("linux"):  # export PyInit__C alone (csrc/exports.map)
        link.append("-Wl,--version-script=" + os.path.join(HERE, "csrc", "exports.map"))
    kwargs = dict(py_limited_api=True, extra_link_args=link)
    if not WITH_CUDA:
        return cpp_extension.CppExtension("fusedops._C", sources, extra_compile_args={"cxx": cxx}, **kwargs)
    nvcc = ["-O3", "-std=c++17", "-lineinfo", "--expt-relaxed-constexpr", *DEFINES]
    if "9.0a" in ARCHS:  # the sm_90a code is in the binary: a 9.0 GPU may take the wgmma kernels
        nvcc.append("-DFUSEDOPS_SM90A")
    return cpp_extension.CUDAExtension("fusedops._C", sources + sorted(glob.glob("csrc/*/*_cuda.cu")),
                                       extra_compile_args={"cxx": cxx, "nvcc": nvcc}, **kwargs)


# The wheel's local version label names the build (PEP 440): a CUDA build and a
# CPU one never share a file name, and `pip list` tells which is installed.
LOCAL = f"cu{torch.version.cuda.replace('.', '')}" if WITH_CUDA else "cpu"

setup(
    name="fusedops",
    version=f"{VERSION}+{LOCAL}",
    packages=["fusedops", "fusedops.ops"],
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExt},
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)
