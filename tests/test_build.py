"""What the built extension shows the rest of the process."""
import shutil
import subprocess
import sys
from importlib import metadata

import pytest
import torch

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


def test_installed_version_names_the_build():
    """The wheel's local version label says which build it is: +cpu, or +cu<version> of
    the CUDA it was built with (so a CUDA wheel and a CPU one never share a file name)."""
    try:
        version = metadata.version("fusedops")
    except metadata.PackageNotFoundError:
        pytest.skip("built in place, not installed: no version metadata")
    cuda = fusedops.build_info()["cuda"]
    assert version.startswith(fusedops.__version__ + "+") and version.endswith("+cpu") != cuda, version
    if cuda:
        assert version.endswith("+cu" + torch.version.cuda.replace(".", "")), version


def test_cuda_build_on_a_cpu_torch_is_named(monkeypatch):
    """A CUDA build imported on a CPU-only torch says so, naming the torch and the way
    out, instead of the loader's bare "libtorch_cuda.so: cannot open shared object file"."""
    loader = ImportError("libtorch_cuda.so: cannot open shared object file: No such file or directory")
    monkeypatch.setattr(torch.version, "cuda", None)
    msg = fusedops._cuda_build_on_cpu_torch(loader)
    assert msg.startswith("fusedops: ") and "needs a CUDA build of torch" in msg, msg
    assert torch.__version__ in msg and "FUSEDOPS_CUDA=0" in msg and "libtorch_cuda.so" in msg, msg
    assert fusedops._cuda_build_on_cpu_torch(ImportError("undefined symbol: PyInit__C")) is None
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    assert fusedops._cuda_build_on_cpu_torch(loader) is None  # a CUDA torch: another problem
