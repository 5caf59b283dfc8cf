"""What the registrations of several ops share.

- check_one_device: the fake kernels' device check. A meta tensor among real
  ones sends the whole call to the fake kernel (Meta outranks CPU and CUDA),
  which would otherwise return uninitialised memory of the real tensors' device.
- register_autograd: torch.library.register_autograd with less Python a call.
- no_double_backward: an autograd formula for a backward op that refuses to be
  differentiated (without it, torch's fallback returns zero second-order
  gradients with only a warning).
- once_only: the same refusal for the backward of an autograd.Function.
- eager_call: an op as fusedops' own functions call it, without the
  dispatcher's round trip through the Python kernels above.
- function_apply: an autograd.Function's apply without Function.apply's
  Python (the C apply, dead functorch wrappers unwrapped as it does).
- register_mutating: the Autograd and ADInplaceOrView kernels of an op that
  writes its inputs (glu_bwd_, glu_packed_bwd_, adam_step). The op bumps the
  version counter of every tensor it writes, as torch's in-place ops do, so that
  autograd refuses a backward through a graph that saved one of them; and it
  refuses, under grad mode, to write a tensor that requires grad (as torch
  refuses an in-place op on a leaf that requires grad), since the op has no
  gradient formula.
"""
import functools
import os

import torch

_lib = torch.library.Library("fusedops", "IMPL")
# Looked up once: each is called on every op call.
_below_autograd = torch._C._AutoDispatchBelowAutograd
_below_inplace = torch._C._AutoDispatchBelowADInplaceOrView
_after_autograd = torch._C._after_autograd_keyset
_grad_enabled = torch._C.is_grad_enabled
_any_requires_grad = torch._C._any_requires_grad
_is_compiling = torch.compiler.is_compiling
_functorch_active = torch._C._are_functorch_transforms_active
_unwrap_if_dead = torch._C._functorch.unwrap_if_dead
_Tensor = torch.Tensor


def _flat(name, value):
    """(name, tensor) pairs of an argument: a tensor, a list of tensors, or None."""
    if isinstance(value, torch.Tensor):
        yield name, value
    elif isinstance(value, (list, tuple)):
        for i, t in enumerate(value):
            if isinstance(t, torch.Tensor):
                yield f"{name}[{i}]", t


def check_one_device(op, **args):
    """RuntimeError unless every tensor of `args` (tensors, lists of tensors,
    None) is on one device; the message is the C++ shims' (csrc/common/shim.h)."""
    first = None
    for name, value in args.items():
        for n, t in _flat(name, value):
            if first is None:
                first = (n, t.device)
            elif t.device != first[1]:
                raise RuntimeError(f"fusedops.{op}: {n} is on {t.device} but {first[0]} is on "
                                   f"{first[1]}; all tensors must be on one device")


def register_autograd(op, backward, setup_context):
    """Autograd for fusedops::<op>, as torch.library.register_autograd(op,
    backward, setup_context=setup_context) gives it: the same Autograd kernel,
    an autograd.Function whose forward redispatches below autograd and calls
    setup_context(ctx, inputs, output) with every argument's default filled in.

    Torch's kernel fills the defaults through fill_defaults, which reads
    schema.arguments (a new list of bound objects each time) once per
    argument; with the other per-call Python it cost add_norm_fwd about 13 us
    of host time a forward (2-core CPU VM, docs/perf-notes.md). Here the
    defaults are read once. Only what fusedops' schemas use is supported: no
    keyword-only arguments, no tensor lists (torch's kernel handles both).
    FUSEDOPS_TORCH_AUTOGRAD=1 at import registers torch's kernel instead, for
    comparison (tools/ci/host_overhead.py).

    Returns the op as fusedops' own Python calls it (eager_call)."""
    overload = getattr(torch.ops.fusedops, op).default
    if os.environ.get("FUSEDOPS_TORCH_AUTOGRAD") == "1":
        torch.library.register_autograd(f"fusedops::{op}", backward, setup_context=setup_context)
        return overload
    schema = overload._schema
    for a in schema.arguments:
        if a.kwarg_only or isinstance(a.type, torch.ListType):
            raise NotImplementedError(f"fusedops register_autograd: {op} has argument {a.name} "
                                      f"({a.type}, kwarg_only={a.kwarg_only}); expected positional "
                                      "arguments without tensor lists")
    defaults = tuple(a.default_value for a in schema.arguments)
    raw = overload._op
    redispatch = overload._handle.redispatch_boxed

    n = len(defaults)

    def forward(ctx, *args):  # args: the op's arguments, then the Autograd kernel's dispatch keyset
        keyset = args[-1]
        args = args[:-1]
        with _below_autograd():
            output = redispatch(keyset & _after_autograd, *args)
        setup_context(ctx, args + defaults[len(args):], output)  # the dispatcher drops defaults
        return output

    def backward_(ctx, *grads):  # (ctx.needs_input_grad ends with the keyset's entry: read it by position)
        return (*backward(ctx, *grads), None)

    def eager_forward(ctx, *args):  # eager_call's: the op's arguments alone, the op called directly
        with _below_autograd():
            output = raw(*args)
        setup_context(ctx, args if len(args) == n else args + defaults[len(args):], output)
        return output

    # grad_fn: fusedops_<op>Backward, from either
    function = type(f"fusedops_{op}", (torch.autograd.Function,),
                    {"forward": staticmethod(forward), "backward": staticmethod(backward_)})
    eager_function = type(f"fusedops_{op}", (torch.autograd.Function,),
                          {"forward": staticmethod(eager_forward), "backward": staticmethod(backward)})
    apply = function_apply(function)

    def autograd_kernel(keyset, *args):
        if _grad_enabled() and _any_requires_grad(*args):
            return apply(*args, keyset)
        with _below_autograd():
            return redispatch(keyset & _after_autograd, *args)

    _lib.impl(op, autograd_kernel, "Autograd", with_keyset=True)
    return eager_call(overload, function_apply(eager_function))


def function_apply(function):
    """function.apply (a torch.autograd.Function) with less Python a call.
    Outside functorch transforms Function.apply unwraps dead functorch
    wrappers among the arguments and calls the C apply; this does the same
    without its classmethod frames and generator."""
    base = torch._C._FunctionBase.__dict__["apply"].__get__(None, function)

    def apply(*args):
        if _is_compiling() or _functorch_active():  # (torch.compile traces Function.apply, not the C apply)
            return function.apply(*args)
        return base(*[_unwrap_if_dead(a) if isinstance(a, _Tensor) else a for a in args])

    return apply


def eager_call(overload, with_grad):
    """fusedops::<op> as fusedops' functions call it: the same op, the same
    autograd formula, without the dispatcher's round trip through the Python
    Autograd kernel (arguments boxed into Python and back, then a redispatch:
    half the host time of a small call). Outside torch.compile, a call whose
    inputs take a gradient goes to with_grad(*args) (an autograd.Function with
    the forward and backward the Autograd kernel applies, less the dispatch
    keyset it carries), any other runs the op below autograd,
    where that kernel would send it. torch.compile sees the op itself, and
    traces its Autograd kernel and fake kernel as before."""
    raw = overload._op

    def call(*args):
        if _is_compiling():
            return overload(*args)
        if _grad_enabled() and _any_requires_grad(*args):
            return with_grad(*args)
        with _below_autograd():
            return raw(*args)

    return call


def double_backward_error(name):
    return RuntimeError(f"fusedops.{name}: double backward is not supported (a backward with "
                        "create_graph=True, then a gradient of that gradient, as a gradient penalty "
                        "takes); fusedops ops are differentiable once only")


def no_double_backward(op):
    """Make a backward op (fusedops::<op>) raise when a gradient is taken
    through it: gradients of gradients are not implemented."""
    def backward(ctx, *grads):
        raise double_backward_error(op)

    return register_autograd(op, backward, lambda ctx, inputs, output: None)


def once_only(name):
    """Decorator for the backward of an autograd.Function that cannot itself be
    differentiated (it calls ops that write their inputs): raise, naming
    `name`, when it runs under create_graph=True (the engine turns grad mode on
    for that). torch's once_differentiable is not enough: it raises at the
    second backward only if the incoming gradient requires grad, so the
    gradient of out.sum() came back without a graph and without an error,
    and a gradient penalty built on it silently added nothing."""
    def wrap(backward):
        @functools.wraps(backward)
        def checked(ctx, *grads):
            if torch.is_grad_enabled():
                raise double_backward_error(name)
            return backward(ctx, *grads)
        return checked
    return wrap


def register_mutating(op):
    """Autograd and ADInplaceOrView kernels for fusedops::<op>, an op that
    writes the arguments its schema marks (a!). Returns the op as fusedops'
    own Python calls it: the two kernels' work done in one Python call, then
    the op below them."""
    overload = getattr(torch.ops.fusedops, op).default
    schema = overload._schema
    written = [(i, a.name) for i, a in enumerate(schema.arguments)
               if a.alias_info is not None and a.alias_info.is_write]

    raw = overload._op
    redispatch = overload._handle.redispatch_boxed

    def tensors_written(args, kwargs):
        for i, name in written:
            value = args[i] if i < len(args) else kwargs.get(name)
            yield from _flat(name, value)

    def values_written(args, kwargs):  # the tensors alone, with little Python per tensor
        out = []
        for i, name in written:
            value = args[i] if i < len(args) else kwargs.get(name)
            if isinstance(value, torch.Tensor):
                out.append(value)
            elif value:
                out.extend(value)
        return out

    def refuse_grad(args, kwargs):
        if _grad_enabled():  # (an optimizer step runs under no_grad: nothing to check)
            for name, t in tensors_written(args, kwargs):
                if t.requires_grad:
                    raise RuntimeError(
                        f"fusedops.{op}: {name} requires grad and would be written in place, "
                        "expected no tensor that requires grad among the written arguments "
                        "(the op has no gradient: call it under torch.no_grad(), as an optimizer "
                        "step does)")

    def autograd_kernel(keyset, *args, **kwargs):
        refuse_grad(args, kwargs)
        with _below_autograd():
            return redispatch(keyset & _after_autograd, *args, **kwargs)

    def inplace_kernel(keyset, *args, **kwargs):
        # one call for all (inference tensors, which have no version, are skipped by torch)
        torch.autograd.graph.increment_version(values_written(args, kwargs))
        with _below_inplace():
            return redispatch(keyset & torch._C._after_ADInplaceOrView_keyset, *args, **kwargs)

    def call(*args, **kwargs):  # both kernels' work, then the op below them (see eager_call)
        if _is_compiling():
            return overload(*args, **kwargs)
        refuse_grad(args, kwargs)
        torch.autograd.graph.increment_version(values_written(args, kwargs))
        with _below_inplace():
            return raw(*args, **kwargs)

    _lib.impl(op, autograd_kernel, "Autograd", with_keyset=True)
    _lib.impl(op, inplace_kernel, "ADInplaceOrView", with_keyset=True)
    return call
