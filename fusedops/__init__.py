"""fusedops: fused training operators for transformers, as torch.ops.fusedops.*"""
import importlib
import sys

import torch  # noqa: F401  (first: the extension links against it)



def _cuda_build_on_cpu_torch(error):
    """The message for a CUDA build imported on a torch without CUDA (the
    loader's own names only libtorch_cuda.so), or None for any other failure."""
    if torch.version.cuda is not None or "cuda" not in str(error).lower():
        return None
    try:
        from importlib.metadata import version
        build = f"fusedops {version('fusedops')}"
    except Exception:  # noqa: BLE001  (built in place: no metadata)
        build = "this fusedops build"
    return (f"fusedops: {build} has CUDA kernels and needs a CUDA build of torch, but torch "
            f"{torch.__version__} has no CUDA. Install a CUDA torch, or rebuild fusedops for the CPU: "
            f"FUSEDOPS_CUDA=0 pip install --no-build-isolation . (the loader said: {error})")


try:
    from . import _C  # registers torch.ops.fusedops.* (static initialisers in the library)
except ImportError as _error:
    _message = _cuda_build_on_cpu_torch(_error)
    if _message is None:
        raise
    raise ImportError(_message) from _error
from . import ops  # noqa: F401  (fake kernels and autograd)
from . import functional, nn, optim  # noqa: F401
from .patch import patch, unpatch  # noqa: E402  (fusedops.patch is the function; the module is in sys.modules)

# The Hugging Face integration registers into the patcher, which never imports it.
sys.modules[__name__ + ".patch"].register_integration(
    "transformers", lambda: importlib.import_module(__name__ + ".hf"), "Hugging Face")

__version__ = "0.1.0"


def build_info():
    """What this build of the extension contains."""
    return {
        "version": __version__,
        "cuda": bool(_C.with_cuda),
        "cuda_archs": _C.cuda_archs.split(";") if _C.cuda_archs else [],
        "torch_target": _C.torch_target,
        "built_with_torch": _C.built_with_torch,
    }
