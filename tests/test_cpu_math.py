"""The CPU kernels' elementary functions (csrc/common/cpu_math.h) at every
ISA level the machine runs: the vector exp gives the scalar one's value
(tests/c/exp_lanes.c, built with the level's flags as setup.py builds that
level's copy)."""
import os
import platform
import shutil
import subprocess

import pytest

from conftest import CPU_LEVEL

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
X86 = platform.machine() in ("x86_64", "AMD64")
LEVEL_FLAGS = {0: [], 3: ["-march=x86-64-v3"], 4: ["-march=x86-64-v4", "-mprefer-vector-width=512"]}


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
@pytest.mark.parametrize("level", [0, 3, 4])
def test_vector_exp_is_the_scalar_exp(level, tmp_path):
    if level and not X86:
        pytest.skip("x86-64 levels")
    if level > CPU_LEVEL:
        pytest.skip(f"the CPU runs level {CPU_LEVEL}, below {level}")
    exe = tmp_path / f"exp_lanes{level}"
    subprocess.run(["gcc", "-std=c11", "-O2", "-Wall", "-Werror", *LEVEL_FLAGS[level], f"-DFO_LEVEL={level}",
                    f"-DFO_X86_LEVELS={int(X86)}", "-I", os.path.join(ROOT, "csrc"),
                    os.path.join(ROOT, "tests", "c", "exp_lanes.c"), "-o", str(exe)], check=True)
    run = subprocess.run([str(exe)], capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.endswith("differing 0\n"), run.stdout + run.stderr
