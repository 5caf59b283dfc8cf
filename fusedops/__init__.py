"""fusedops: fused training operators for transformers, as torch.ops.fusedops.*"""
import torch  # noqa: F401  (first: the extension links against it)

from . import _C  # registers torch.ops.fusedops.* (static initialisers in the library)
from . import ops  # noqa: F401  (fake kernels and autograd)
from . import functional, nn, optim  # noqa: F401
from .patch import patch, unpatch  # noqa: E402  (fusedops.patch is the function; the module is in sys.modules)

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
