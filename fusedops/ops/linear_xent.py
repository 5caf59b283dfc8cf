"""fusedops::linear_xent_fwd / linear_xent_bwd: cross_entropy(input @ weight.T
+ bias, target) without the logits (docs/linear-cross-entropy.md).

Schemas (csrc/library.cpp):
  linear_xent_fwd(input, weight, bias, target, ignore_index, reduction,
                  label_smoothing, softcap, input_grad, weight_grad, bias_grad,
                  num_items=None)     # the mean's divisor, else the count
      -> (loss, dinput, dweight, dbias)
  linear_xent_bwd(dloss, input, weight, bias, target, ignore_index,
                  label_smoothing, softcap, input_grad, weight_grad, bias_grad)
      -> (dinput, dweight, dbias)
  linear_xent_scale_(grad!, dloss) -> ()   # C / CUDA (csrc/xent): grad *= dloss,
                                           # nothing touched where dloss is 1

Both are implemented here, in Python, for the CPU and CUDA: a loop over
chunks of rows whose matmuls are torch's (cuBLAS, the CPU BLAS) and whose
loss and logit gradient are one xent_fwd_bwd_ pass over the chunk's logits,
written over them. Per chunk c of rows:

    z = input[c] @ weight.T (+ bias)          # the chunk's logits, [rows_c, classes]
    loss[c] = xent_fwd_bwd_(z, ...)           # z is now d loss / d logits
    dinput[c] = z @ weight
    dweight += z.T @ input[c]                 # the first chunk writes it
    dbias += z.sum(0)                         # in fp32

so only one chunk's logits exist at a time, and with reduction "mean" or
"sum" the forward hands out the gradients of the loss: the backward only
scales them by the loss's gradient (in place: nothing of the size of the
weight is allocated twice; and where that gradient is 1, the usual case of
a loss that backward() starts from, not even read: linear_xent_scale_ reads
it on the device). With "none" the gradient of each row's loss has
its own factor, which cannot be applied to dweight afterwards: the forward
computes the losses alone and the backward runs the chunks again with the
row factors (a fourth matmul). The ops are opaque to torch.compile (their
fake kernels give the shapes), which would otherwise unroll the loop and
keep every chunk's logits alive for the backward.
"""
import torch

from . import xent as _xent
from ._common import (_lib, check_one_device, double_backward_error, no_double_backward, register_autograd,
                      register_mutating)

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# A chunk's logits hold at most this share of the weight's bytes (with the
# "input" policy also at most the input's bytes), a chunk holds at least
# MIN_ROWS rows ("weight"), and the rows make at most MAX_CHUNKS chunks (see
# chunk_rows).
WEIGHT_SHARE = 4
MIN_ROWS = 256
MAX_CHUNKS = 32

# How chunk_rows sizes a chunk (its docstring): POLICY is the library's; the
# others are variants that tools/probes/linear_xent.py measures beside it,
# and the tests run. In-process only (no API, no environment switch): set
# _POLICY to one of POLICIES, or _CHUNK_ROWS to a number of rows (the tests:
# chunk boundaries inside small inputs).
POLICIES = ("weight", "input", "free")
POLICY = "weight"
_POLICY = None
_CHUNK_ROWS = None


def chunk_rows(rows, classes, hidden, itemsize, free_bytes=None, policy=None):
    """Rows of logits a chunk holds, by policy (default _POLICY or POLICY).

    "weight": the step keeps dweight (classes x hidden) whatever the
    chunking, so a chunk's logits (rows_c x classes) are held to a quarter of
    its size: rows_c <= hidden / 4 (1024 at hidden 4096), the peak then at
    most 1.25x the weight's bytes plus dinput. Fewer rows would make more
    passes over dweight (its update reads and writes all of it a chunk), more
    would raise the peak. Two lower bounds: MIN_ROWS (matmuls of fewer rows
    run well below the machine's rate), and rows / MAX_CHUNKS, because a
    16-bit dweight is rounded once a chunk: past about 64 roundings its error
    leaves the 2x rule's bound (docs/linear-cross-entropy.md).
    "input": a chunk's logits at most the input's bytes (rows_c <= rows
    hidden / classes) and a quarter of the weight's, without the MIN_ROWS
    floor: Liger-Kernel's chunks (the input's count of logits, rounded up to
    a power of two rows), hence its peak, where the vocabulary is large
    against the tokens; the MAX_CHUNKS bound still holds (262144 words at
    8192 tokens: 256 rows, where Liger takes 128). Many more passes over
    dweight.
    "free": one chunk where half the free memory holds it (the fewest passes
    over dweight; on the CPU, one chunk).
    free_bytes (on CUDA: what the allocator can still give) caps them all: a
    chunk never takes more than half of it. The rows are then spread evenly
    over the chunks that count needs, in multiples of 8."""
    if _CHUNK_ROWS is not None:
        return max(1, min(rows, _CHUNK_ROWS))
    policy = policy or _POLICY or POLICY
    if policy not in POLICIES:
        raise ValueError(f"fusedops.linear_xent: chunk policy {policy!r}, expected one of {POLICIES}")
    if policy == "free":
        want = rows
    elif policy == "input":
        want = max(8, min(hidden // WEIGHT_SHARE, rows * hidden // classes), -(-rows // MAX_CHUNKS))
    else:
        want = max(MIN_ROWS, hidden // WEIGHT_SHARE, -(-rows // MAX_CHUNKS))
    if free_bytes is not None:
        want = min(want, max(8, free_bytes // (2 * classes * itemsize)))
    if rows <= want:
        return max(rows, 1)
    chunks = -(-rows // want)
    per = -(-rows // chunks)
    return min(rows, -(-per // 8) * 8)


def _free_bytes(device):
    """What the caching allocator can hand out on a CUDA device without
    asking for more than the device has free: the device's free memory plus
    what the allocator holds unused. None on other devices."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def check_args(op, input, weight, bias, target, ignore_index=None, label_smoothing=0.0, softcap=0.0):
    """Raise a RuntimeError naming op unless input [rows, hidden], weight
    [classes, hidden] (input's dtype: fp32, fp16 or bf16), bias [classes] or
    None (weight's dtype), target [rows] int64, all on one device; on the CPU,
    where the targets can be read without a sync, every target a class or
    ignore_index."""
    check_one_device(op, input=input, weight=weight, bias=bias, target=target)
    name = f"fusedops.{op}"
    if input.dim() != 2:
        raise RuntimeError(f"{name}: input has shape {list(input.shape)}, expected [rows, hidden]")
    if input.dtype not in KERNEL_DTYPES:
        raise RuntimeError(f"{name}: input has dtype {str(input.dtype)[6:]}, expected float32, float16 or bfloat16")
    if weight.dim() != 2 or weight.shape[1] != input.shape[1] or weight.shape[0] < 1:
        raise RuntimeError(f"{name}: weight has shape {list(weight.shape)}, expected [classes, {input.shape[1]}] "
                           "(classes >= 1; the input's last dimension)")
    if weight.dtype != input.dtype:
        raise RuntimeError(f"{name}: weight has dtype {str(weight.dtype)[6:]}, expected the dtype of input "
                           f"({str(input.dtype)[6:]})")
    if bias is not None and (bias.shape != weight.shape[:1] or bias.dtype != weight.dtype):
        raise RuntimeError(f"{name}: bias has shape {list(bias.shape)} and dtype {str(bias.dtype)[6:]}, expected "
                           f"[{weight.shape[0]}] and {str(weight.dtype)[6:]} (a value a class, weight's dtype)")
    if target.dtype != torch.int64:
        raise RuntimeError(f"{name}: target has dtype {str(target.dtype)[6:]}, expected int64 (class indices)")
    if target.shape != input.shape[:1]:
        raise RuntimeError(f"{name}: target has shape {list(target.shape)}, expected [{input.shape[0]}] "
                           "(a class index a row of input)")
    if not 0.0 <= label_smoothing <= 1.0:
        raise RuntimeError(f"{name}: label_smoothing is {label_smoothing}, expected a number in [0, 1]")
    if not 0.0 <= softcap < float("inf"):
        raise RuntimeError(f"{name}: softcap is {softcap}, expected a finite number > 0, or 0 for none")
    if ignore_index is not None and target.device.type == "cpu" and target.numel():
        bad = ((target < 0) | (target >= weight.shape[0])) & (target != ignore_index)
        if bad.any():
            r = int(bad.nonzero()[0, 0])
            raise RuntimeError(f"{name}: target[{r}] is {int(target[r])}, expected a class in [0, "
                               f"{weight.shape[0]}) or ignore_index ({ignore_index})")


def _empty(like):
    return like.new_empty((0,))


def _chunks(rows, classes, hidden, input):
    step = chunk_rows(rows, classes, hidden, input.element_size(), _free_bytes(input.device))
    return step, [(a, min(a + step, rows)) for a in range(0, rows, step)]


def _logits(x, weight, bias, out):
    """out = x @ weight.T (+ bias): the chunk's logits, in a buffer reused by
    every chunk."""
    if bias is None:
        return torch.mm(x, weight.t(), out=out)
    return torch.addmm(bias, x, weight.t(), out=out)


def _chunked_grads(input, weight, bias, target, dloss, loss, ignore_index, label_smoothing, softcap,
                   input_grad, weight_grad, bias_grad):
    """The gradients of sum_r dloss[r] loss_r (dloss [rows] fp32, any
    stride), chunk by chunk; each chunk's losses go to loss[rows of chunk]."""
    rows, hidden = input.shape
    classes = weight.shape[0]
    dinput = input.new_empty(input.shape) if input_grad else _empty(input)
    dweight = (weight.new_empty(weight.shape) if rows else torch.zeros_like(weight)) if weight_grad else _empty(weight)
    dbias = torch.zeros(classes, dtype=torch.float32, device=input.device) if bias_grad else None
    step, chunks = _chunks(rows, classes, hidden, input)
    buf = input.new_empty((min(step, rows), classes))
    for i, (a, b) in enumerate(chunks):
        x = input[a:b]
        z = _logits(x, weight, bias, buf[:b - a])
        loss[a:b] = _xent.xent_fwd_bwd_(z, target[a:b], dloss[a:b], ignore_index, label_smoothing, softcap)
        if input_grad:
            torch.mm(z, weight, out=dinput[a:b])
        if weight_grad:
            if i == 0:
                torch.mm(z.t(), x, out=dweight)
            else:
                dweight.addmm_(z.t(), x)
        if bias_grad:
            dbias += z.sum(0, dtype=torch.float32)
    return dinput, dweight, (dbias.to(bias.dtype) if bias_grad else _empty(input))


def _count(target, ignore_index, num_items=None):
    """The mean's divisor: num_items (a one-value tensor, on target's device)
    or the count of targets that are not ignored."""
    if num_items is not None:
        return num_items.reshape(()).to(device=target.device, dtype=torch.float32)
    return (target != ignore_index).sum()


def _check_num_items(op, num_items):
    if num_items is not None and num_items.numel() != 1:
        raise RuntimeError(f"fusedops.{op}: num_items has shape {list(num_items.shape)}, expected one number "
                           "(the mean's divisor)")


def _fwd_impl(input, weight, bias, target, ignore_index, reduction, label_smoothing, softcap, input_grad,
              weight_grad, bias_grad, num_items=None):
    op = "linear_xent_fwd"
    check_args(op, input, weight, bias, target, ignore_index, label_smoothing, softcap)
    _xent.check_reduction(op, reduction)
    _check_num_items(op, num_items)
    bias_grad = bias_grad and bias is not None
    rows, hidden = input.shape
    classes = weight.shape[0]
    with torch.autocast(input.device.type, enabled=False):  # the matmuls in the inputs' dtype, as asked
        loss = input.new_empty((rows,), dtype=torch.float32)
        if reduction != "none" and (input_grad or weight_grad or bias_grad):
            scale = torch.ones((), dtype=torch.float32, device=input.device)
            if reduction == "mean":
                scale = scale / _count(target, ignore_index, num_items)
            grads = _chunked_grads(input, weight, bias, target, scale.expand(rows), loss, ignore_index,
                                   label_smoothing, softcap, input_grad, weight_grad, bias_grad)
        else:
            grads = (_empty(input), _empty(weight), _empty(input))
            step, chunks = _chunks(rows, classes, hidden, input)
            buf = input.new_empty((min(step, rows), classes))
            for a, b in chunks:
                z = _logits(input[a:b], weight, bias, buf[:b - a])
                loss[a:b] = _xent.xent_fwd(z, target[a:b], ignore_index, label_smoothing, softcap)[0]
        if reduction == "sum":
            loss = loss.sum()
        elif reduction == "mean":
            loss = loss.sum() / _count(target, ignore_index, num_items)
    return (loss, *grads)


def _bwd_impl(dloss, input, weight, bias, target, ignore_index, label_smoothing, softcap, input_grad,
              weight_grad, bias_grad):
    op = "linear_xent_bwd"
    check_args(op, input, weight, bias, target, None, label_smoothing, softcap)
    check_one_device(op, dloss=dloss, input=input)
    if dloss.shape != input.shape[:1] or dloss.dtype != torch.float32:
        raise RuntimeError(f"fusedops.{op}: dloss has shape {list(dloss.shape)} and dtype {str(dloss.dtype)[6:]}, "
                           f"expected [{input.shape[0]}] and float32 (a value a row)")
    with torch.autocast(input.device.type, enabled=False):
        scratch = input.new_empty((input.shape[0],), dtype=torch.float32)
        return _chunked_grads(input, weight, bias, target, dloss, scratch, ignore_index, label_smoothing,
                              softcap, input_grad, weight_grad, bias_grad and bias is not None)


for _key in ("CPU", "CUDA"):
    _lib.impl("linear_xent_fwd", _fwd_impl, _key)
    _lib.impl("linear_xent_bwd", _bwd_impl, _key)


def _fake_grads(input, weight, bias, input_grad, weight_grad, bias_grad):
    return (input.new_empty(input.shape) if input_grad else _empty(input),
            weight.new_empty(weight.shape) if weight_grad else _empty(weight),
            bias.new_empty(bias.shape) if bias_grad and bias is not None else _empty(input))


@torch.library.register_fake("fusedops::linear_xent_fwd")
def _fwd_fake(input, weight, bias, target, ignore_index, reduction, label_smoothing, softcap, input_grad,
              weight_grad, bias_grad, num_items=None):
    check_args("linear_xent_fwd", input, weight, bias, target, None, label_smoothing, softcap)
    _check_num_items("linear_xent_fwd", num_items)
    loss = input.new_empty((input.shape[0],) if reduction == "none" else (), dtype=torch.float32)
    if reduction == "none":
        return loss, _empty(input), _empty(weight), _empty(input)
    return (loss, *_fake_grads(input, weight, bias, input_grad, weight_grad, bias_grad))


@torch.library.register_fake("fusedops::linear_xent_scale_")
def _scale_fake(grad, dloss):
    check_one_device("linear_xent_scale_", grad=grad, dloss=dloss)


@torch.library.register_fake("fusedops::linear_xent_bwd")
def _bwd_fake(dloss, input, weight, bias, target, ignore_index, label_smoothing, softcap, input_grad,
              weight_grad, bias_grad):
    check_args("linear_xent_bwd", input, weight, bias, target, None, label_smoothing, softcap)
    check_one_device("linear_xent_bwd", dloss=dloss, input=input)
    return _fake_grads(input, weight, bias, input_grad, weight_grad, bias_grad)


def _setup_context(ctx, inputs, output):
    input, weight, bias, target, ignore_index, reduction, label_smoothing, softcap, *flags, _ = inputs
    _, dinput, dweight, dbias = output
    ctx.mark_non_differentiable(dinput, dweight, dbias)
    # No zero-filled gradients of those three made for the backward (by
    # default autograd makes them: one of the weight's size).
    ctx.set_materialize_grads(False)
    ctx.none = reduction == "none"
    ctx.flags = flags
    ctx.args = (ignore_index, label_smoothing, softcap, *flags)
    if ctx.none:
        ctx.save_for_backward(input, weight, bias, target)
    else:
        ctx.save_for_backward(dinput, dweight, dbias)


_ARGS = ("input", "weight", "bias")


def _backward(ctx, dloss, *_):
    wanted = ctx.needs_input_grad[:3]
    for name, want, flag in zip(_ARGS, wanted, ctx.flags):
        if want and not flag:
            raise RuntimeError(f"fusedops.linear_xent_fwd: the gradient of {name} is asked for, but {name}_grad "
                               "was False in the forward")
    if dloss is None:
        return (None,) * 12
    if torch.is_grad_enabled() and not torch.compiler.is_compiling():  # create_graph=True
        raise double_backward_error("linear_xent_fwd")
    if ctx.none:
        grads = linear_xent_bwd(dloss, *ctx.saved_tensors, *ctx.args)
    else:
        # The forward's gradients times the loss's, in place in eager, so
        # that dweight is not allocated twice (the saved tensors are handed
        # out once: a second backward through the graph is refused by
        # autograd's version check). Out of place where the tensors are
        # traced (torch.compile, opcheck: fake or functional tensors, a
        # subclass of Tensor), whose graphs must not write the forward's
        # outputs, and for any other subclass.
        grads = ctx.saved_tensors
        eager = type(dloss) is torch.Tensor and all(type(g) is torch.Tensor for g in grads)
        if eager:
            for g in grads:
                if g.numel():
                    linear_xent_scale_(g, dloss)
        else:
            grads = [g * dloss for g in grads]
    return (*(g if want else None for g, want in zip(grads, wanted)),) + (None,) * 9


# The ops as fusedops calls them (_common.eager_call).
linear_xent_fwd = register_autograd("linear_xent_fwd", _backward, _setup_context)
linear_xent_bwd = no_double_backward("linear_xent_bwd")
linear_xent_scale_ = register_mutating("linear_xent_scale_")
