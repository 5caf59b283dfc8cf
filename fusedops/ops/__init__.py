"""Fake (meta) kernels and autograd formulas of the fusedops custom ops.

The ops themselves are defined in C++ (csrc/library.cpp) and implemented per
device by the compiled extension; importing this package attaches what
torch.compile and autograd need to them."""
from . import adam, attention, norm, rope, swiglu, xent  # noqa: F401
from . import linear_xent  # noqa: F401  (after xent, whose ops it calls)
