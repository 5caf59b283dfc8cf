"""What the built extension shows the rest of the process."""
import shutil
import subprocess
import sys

import pytest

import fusedops


@pytest.mark.skipif(not sys.platform.startswith("linux") or shutil.which("nm") is None,
                    reason="the export list is a Linux linker script (csrc/exports.map); needs nm")
def test_exports_only_the_entry_points():
    # Every symbol of ours the dynamic linker can bind: CPython's entry point and
    # the tests' three ctypes hooks. The per-level kernels (fo_*_cpu_v3, ...) and
    # the CUDA launchers must not be among them.
    out = subprocess.run(["nm", "-D", "--defined-only", fusedops._C.__file__],
                         capture_output=True, text=True, check=True).stdout
    exported = {line.split()[-1] for line in out.splitlines() if line.strip()}
    assert exported == {"PyInit__C", "fo_cpu_isa", "fo_cpu_set_isa", "fo_cpu_convert"}
