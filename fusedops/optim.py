"""Drop-in Adam / AdamW backed by fusedops' multi-tensor kernel (csrc/adam).

    opt = fusedops.optim.FusedAdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    opt = fusedops.optim.FusedAdamW(model.parameters(), master_weights=True)  # bf16 model

FusedAdam and FusedAdamW take torch.optim.Adam's and AdamW's arguments and keep
the same state (per parameter: 'step', a one-element fp32 tensor on the
parameter's device, 'exp_avg', 'exp_avg_sq', 'max_exp_avg_sq' with amsgrad), so
a state_dict of either loads into the other. One step is one call of
torch.ops.fusedops.adam_step per parameter group, device, parameter dtype and
master-weights setting: one or a few kernel launches, never a host sync.

Beyond torch:
  master_weights=True   for float16 / bfloat16 parameters, keep an fp32 master
                        copy (state 'master_param') and fp32 states; the kernel
                        updates the master and writes it, rounded, into the
                        parameter. Loading a state without master copies (torch's)
                        makes them from the parameters.

As in torch: parameters without a grad are skipped; lr may be a tensor (kept
on the device: schedulers that write into it work under CUDA graphs);
GradScaler passes grad_scale / found_inf (the kernel unscales the grads it reads
and skips the whole step, step counts included, when an inf/nan was found);
complex64 parameters are updated as their real view (torch's math); DTensor
parameters (FSDP2 shards) are updated through their local shards; a parameter
that is a view with gaps is updated through a contiguous copy, written back.
Differences: every step is CUDA-graph safe (capturable is accepted and kept in
the param groups for torch's sake); foreach and fused are accepted and ignored;
grads are never written (torch's fused kernels store the unscaled grads back
when a GradScaler is used; here .grad keeps the scaled values); sparse grads and
float64 parameters raise.
"""
import torch
from torch.optim.optimizer import Optimizer

from .ops import adam as _adam

_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_HALF = (torch.float16, torch.bfloat16)
_STATE_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master_param")


def _dtensor_type():
    try:
        from torch.distributed.tensor import DTensor
        return DTensor
    except Exception:  # noqa: BLE001  (torch built without distributed)
        return None


_DTENSOR = _dtensor_type()


def _local(t):
    """The tensor the kernel updates: a DTensor's local shard, a complex
    tensor's real view, else t itself."""
    if _DTENSOR is not None and isinstance(t, _DTENSOR):
        t = t._local_tensor
    return torch.view_as_real(t) if t.is_complex() else t


class FusedAdam(Optimizer):
    """torch.optim.Adam on fusedops' fused multi-tensor kernel (see the module
    docstring); decoupled_weight_decay=True makes it AdamW."""

    _step_supports_amp_scaling = True  # GradScaler hands us grad_scale / found_inf
    _name = "FusedAdam"

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 amsgrad=False, *, foreach=None, maximize=False, capturable=False,
                 differentiable=False, fused=None, decoupled_weight_decay=False,
                 master_weights=False):
        if isinstance(lr, torch.Tensor) and lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        for i, b in enumerate(betas):
            if not 0.0 <= b < 1.0:
                raise ValueError(f"Invalid beta parameter at index {i}: {b}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if differentiable:
            raise RuntimeError(f"{self._name} does not support differentiable=True")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize, foreach=foreach, capturable=capturable,
                        differentiable=differentiable, fused=fused,
                        decoupled_weight_decay=decoupled_weight_decay,
                        master_weights=master_weights)
        super().__init__(params, defaults)

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:
            for key, value in (("amsgrad", False), ("maximize", False), ("foreach", None),
                               ("capturable", False), ("differentiable", False), ("fused", None),
                               ("decoupled_weight_decay", False), ("master_weights", False)):
                group.setdefault(key, value)

    # ------------------------------------------------------------------ state
    def _state_dtype(self, p, group):
        """fp32 with master weights for a 16-bit parameter, else the parameter's dtype."""
        return torch.float32 if group["master_weights"] and p.dtype in _HALF else p.dtype

    def _prepare_state(self, p, group, source=None):
        """Create the state of p, or bring it (or `source`, a state loaded from a
        state_dict) to what the kernel takes: an fp32 step on p's device, states in
        _state_dtype, a master copy exactly when master weights apply."""
        state = self.state[p]
        source = state if source is None else source
        dtype = self._state_dtype(p, group)
        master = dtype != p.dtype
        if len(source) == 0:
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            zeros = lambda: torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)  # noqa: E731
            state["exp_avg"] = zeros()
            state["exp_avg_sq"] = zeros()
            if group["amsgrad"]:
                state["max_exp_avg_sq"] = zeros()
            if master:
                state["master_param"] = p.detach().to(torch.float32, copy=True)
            return state
        fresh = source is not state  # a loaded state: copy, never alias the caller's tensors
        step = source["step"]
        step = torch.as_tensor(step) if not torch.is_tensor(step) else step
        if fresh or step.dtype != torch.float32 or step.device != p.device:
            state["step"] = step.to(device=p.device, dtype=torch.float32, copy=True).reshape(())
        for key in _STATE_KEYS[:3]:
            if key in source and (fresh or source[key].dtype != dtype or source[key].device != p.device):
                state[key] = source[key].to(device=p.device, dtype=dtype, copy=True)
        if group["amsgrad"] and "max_exp_avg_sq" not in state:
            state["max_exp_avg_sq"] = torch.zeros_like(state["exp_avg_sq"])
        if master:
            if "master_param" in source:
                state["master_param"] = source["master_param"].to(
                    device=p.device, dtype=torch.float32, copy=fresh)
            else:
                state["master_param"] = p.detach().to(torch.float32, copy=True)
        else:
            state.pop("master_param", None)
        return state

    def state_dict(self):
        """torch's state_dict, with master_weights left out of the groups where
        it is off: the keys are then torch's Adam's / AdamW's exactly, which
        torch.distributed.checkpoint's get_state_dict / set_state_dict need to
        load the one's state into the other (load_state_dict keeps the current
        setting where a group does not say)."""
        sd = super().state_dict()
        for group in sd["param_groups"]:  # (copies of self.param_groups')
            if not group.get("master_weights", False):
                group.pop("master_weights", None)
        return sd

    def load_state_dict(self, state_dict):
        """torch's load_state_dict, then each state brought to the kernel's form
        from the tensors as saved: torch's loader casts floating-point state to
        the parameter's dtype, which would round our fp32 states of 16-bit
        parameters; the originals are used instead."""
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        saved = dict(state_dict["state"])
        # master_weights is ours, not a hyperparameter of torch's checkpoints:
        # where the saved group does not say, the current setting stays.
        keep = [g["master_weights"] for g in self.param_groups]
        has = ["master_weights" in g for g in state_dict["param_groups"]]
        super().load_state_dict(state_dict)
        for group, mw, saved_has in zip(self.param_groups, keep, has):
            if not saved_has:
                group["master_weights"] = mw
        params = [(p, g) for g in self.param_groups for p in g["params"]]
        for sid, (p, group) in zip(saved_ids, params):
            if sid in saved and p in self.state:
                self._prepare_state(p, group, source=saved[sid])

    # ------------------------------------------------------------------ step
    def _buckets(self, group):
        """The params of a group that have grads, as kernel lists per (device,
        dtype, master weights), and (param, dense copy) pairs to write back
        after the step: the kernel walks a param as one array, so a param that
        is not dense (a view with gaps, as torch.optim takes) is updated in a
        contiguous copy, and its states are contiguous (zeros_like makes them
        so)."""
        seen = {}
        for i, p in enumerate(group["params"]):  # first, so that nothing has changed if it raises
            if p.grad is not None and seen.setdefault(id(p), i) != i:
                # torch.optim warns of such groups and means to reject them
                raise RuntimeError(f"{self._name}: parameters {seen[id(p)]} and {i} of a group are the "
                                   "same tensor; the fused step would update it twice at once. Pass "
                                   "each parameter once")
        buckets, write_back = {}, []
        for i, p in enumerate(group["params"]):
            if p.grad is None:
                continue
            if p.grad.is_sparse or p.grad.layout != torch.strided:
                raise RuntimeError(f"{self._name} does not support sparse gradients (parameter {i} "
                                   "of its group); consider torch.optim.SparseAdam")
            local = _local(p)
            if local.dtype not in _KERNEL_DTYPES:
                raise RuntimeError(f"{self._name}: parameter {i} of its group has dtype {p.dtype}; "
                                   "the fused kernel takes float32, float16, bfloat16 and complex64")
            state = self._prepare_state(p, group)
            if not (local.is_contiguous() or torch.empty_like(local).stride() == local.stride()):
                write_back.append((local, local.contiguous()))
                local = write_back[-1][1]
            grad = _local(p.grad)
            if grad.dtype != local.dtype or grad.stride() != local.stride():
                grad = torch.empty_like(local).copy_(grad)  # the param's dtype and layout
            master = "master_param" in state
            b = buckets.setdefault((local.device, local.dtype, master),
                                   dict(params=[], grads=[], exp_avgs=[], exp_avg_sqs=[],
                                        max_exp_avg_sqs=[], master_params=[], steps=[]))
            b["params"].append(local)
            b["grads"].append(grad)
            b["exp_avgs"].append(_local(state["exp_avg"]))
            b["exp_avg_sqs"].append(_local(state["exp_avg_sq"]))
            if group["amsgrad"]:
                b["max_exp_avg_sqs"].append(_local(state["max_exp_avg_sq"]))
            if master:
                b["master_params"].append(_local(state["master_param"]))
            b["steps"].append(state["step"])
        return buckets, write_back

    @staticmethod
    def _on(t, device):
        """A one-element tensor as the kernel reads it: fp32 on `device` (t itself
        when it already is, so that writes into it reach a captured graph)."""
        if t is None or (t.device == device and t.dtype == torch.float32):
            return t
        return t.to(device=device, dtype=torch.float32, non_blocking=True)

    @torch.no_grad()
    def step(self, closure=None):
        """Perform a single optimization step.

        Args:
            closure (Callable, optional): A closure that reevaluates the model
                and returns the loss.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        for group in self.param_groups:
            lr = group["lr"]
            lr_tensor = lr if isinstance(lr, torch.Tensor) else None
            beta1, beta2 = (float(b) for b in group["betas"])
            buckets, write_back = self._buckets(group)
            for (device, _, _), b in buckets.items():
                _adam.adam_step(
                    b["params"], b["grads"], b["exp_avgs"], b["exp_avg_sqs"], b["max_exp_avg_sqs"],
                    b["master_params"], b["steps"], 0.0 if lr_tensor is not None else float(lr),
                    beta1, beta2, float(group["eps"]), float(group["weight_decay"]),
                    bool(group["decoupled_weight_decay"]), bool(group["amsgrad"]),
                    bool(group["maximize"]), self._on(lr_tensor, device),
                    self._on(grad_scale, device), self._on(found_inf, device))
            for param, dense in write_back:
                param.copy_(dense)
        return loss


class FusedAdamW(FusedAdam):
    """torch.optim.AdamW on fusedops' fused multi-tensor kernel (see the module
    docstring)."""

    _name = "FusedAdamW"

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, *, maximize=False, foreach=None, capturable=False,
                 differentiable=False, fused=None, master_weights=False):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, foreach=foreach,
                         maximize=maximize, capturable=capturable, differentiable=differentiable,
                         fused=fused, decoupled_weight_decay=True, master_weights=master_weights)

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:
            group["decoupled_weight_decay"] = True  # as torch.optim.AdamW
