"""Shared fixtures and helpers of the fusedops tests: the devices to run on,
per-test seeding, random inputs and output poisoning."""
import contextlib
import ctypes
import zlib

import pytest
import torch
import torch.utils.deterministic

import fusedops  # noqa: F401  (registers torch.ops.fusedops.*)

# CUDA tests need a GPU and a build with CUDA kernels: a CPU-only build
# (FUSEDOPS_CUDA=0) on a GPU machine skips them rather than failing each with
# "Could not run 'fusedops::...' with arguments from the 'CUDA' backend".
HAS_CUDA = torch.cuda.is_available() and fusedops.build_info()["cuda"]

# The devices present: CPU always, CUDA when a GPU is (and the build has it).
devices = ["cpu"] + (["cuda"] if HAS_CUDA else [])

requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU and a CUDA build of fusedops")

# The x86-64 level the CPU kernels run at (csrc/common/dtype_cpu.c: 0, 3, 4,
# 5 = 4 with AVX512-BF16, or 6 = 5 with AMX tiles), read and set through the
# extension's C entry points.
CPU_LIB = ctypes.CDLL(fusedops._C.__file__)
CPU_LIB.fo_cpu_isa.restype = ctypes.c_int
CPU_LIB.fo_cpu_set_isa.argtypes = [ctypes.c_int]
CPU_LIB.fo_cpu_set_isa.restype = ctypes.c_int
CPU_LEVEL = CPU_LIB.fo_cpu_isa()  # the level the kernels run at (FUSEDOPS_CPU_ISA may lower it)


@contextlib.contextmanager
def tuned(**knobs):
    """The CUDA plans' tuning knobs (csrc/common/tune.h) set for a block, in
    this process, and restored after it."""
    old = {}
    try:
        for name, value in knobs.items():
            old[name] = fusedops._C._tune(name, value)
        yield
    finally:
        for name, value in old.items():
            fusedops._C._tune(name, value)


@contextlib.contextmanager
def cpu_level(level):
    """The CPU kernels at `level` (at most CPU_LEVEL) inside the block."""
    was = CPU_LIB.fo_cpu_isa()
    assert CPU_LIB.fo_cpu_set_isa(level) == level
    try:
        yield
    finally:
        CPU_LIB.fo_cpu_set_isa(was)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=requires_cuda)])
def device(request):
    """Every test taking `device` runs on the CPU and on CUDA; the CUDA cases
    show up as skipped where no GPU is present."""
    return request.param


@pytest.fixture
def gloo_world():
    """A one-process gloo process group for the test (DTensors, FSDP2)."""
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    if dist.is_initialized():
        pytest.skip("a process group is already initialised")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist
    finally:
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _seed(request):
    """Seed from the test's node id: each parametrised case gets its own random
    inputs, and rerunning one case (by its node id or -k) gives the same ones."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


def randn(shape, dtype, device):
    """Standard normals drawn in fp32 and rounded to dtype (never zeros)."""
    return torch.randn(shape, device=device).to(dtype)


@contextlib.contextmanager
def poisoned(device):
    """Tensors allocated inside the block start out as NaN, so that an output
    element a kernel forgets to write shows up as NaN.

    Two mechanisms:
    1. a large NaN-filled block is allocated and freed on the device right
       before, so that the CUDA caching allocator hands that memory out again
       (on the CPU, malloc gives no such guarantee: large blocks go back to the
       system), and
    2. torch's deterministic mode with fill_uninitialized_memory, under which
       every torch.empty / new_empty (the extension allocates its outputs
       through these) fills floating-point tensors with NaN, on any device.
       warn_only: other torch ops that have no deterministic variant warn
       instead of raising."""
    det = torch.utils.deterministic
    saved = (torch.are_deterministic_algorithms_enabled(),
             torch.is_deterministic_algorithms_warn_only_enabled(), det.fill_uninitialized_memory)
    big = (256 << 20) if torch.device(device).type == "cuda" else (16 << 20)
    # The large pool, then whole 2 MiB small-pool segments (CUDA). All-ones bits
    # are a NaN in every floating dtype.
    blocks = [torch.empty(n, dtype=torch.uint8, device=device).fill_(0xFF) for n in (big, 1 << 20, 1 << 20)]
    del blocks
    torch.use_deterministic_algorithms(True, warn_only=True)
    det.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        det.fill_uninitialized_memory = saved[2]


def maybe_poisoned(device, on):
    return poisoned(device) if on else contextlib.nullcontext()


def bits(t):
    """t's bits as integers, for bitwise comparison (NaN payloads included)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def tensors_of(args):
    """(name, tensor) for the tensors of a dict of arguments: tensors, tensors in
    lists, the parameters of modules (meta and sparse tensors, which hold no
    values to compare, left out)."""
    for k, v in args.items():
        if isinstance(v, torch.nn.Module):
            items = [(f"{k}.{n}", p) for n, p in v.named_parameters()]
        elif isinstance(v, (list, tuple)):
            items = [(f"{k}[{i}]", t) for i, t in enumerate(v)]
        else:
            items = [(k, v)]
        yield from ((n, t) for n, t in items if isinstance(t, torch.Tensor)
                    and t.layout == torch.strided and t.device.type != "meta")


def snapshot(args):
    return {n: bits(t.detach()).clone() for n, t in tensors_of(args)}


def assert_unchanged(args, before, what=""):
    """Every tensor of `args` bitwise as in `before` (snapshot(args))."""
    for n, t in tensors_of(args):
        assert torch.equal(bits(t.detach()), before[n]), f"{what}{n} was modified"


def raises_unchanged(fn, args, match, exc=RuntimeError):
    """fn(**args) raises `exc` matching `match` and modifies no argument."""
    before = snapshot(args)
    with pytest.raises(exc, match=match):
        fn(**args)
    assert_unchanged(args, before)
