"""Fake kernel and the in-place kernels (fusedops/ops/_common.py) of fusedops::adam_step.

Schema (csrc/library.cpp):
  adam_step(params!, grads, exp_avgs!, exp_avg_sqs!, max_exp_avg_sqs!, master_params!,
            steps!, lr, beta1, beta2, eps, weight_decay, decoupled_weight_decay,
            amsgrad, maximize, lr_tensor?, grad_scale?, found_inf?) -> ()

The op updates its mutable lists in place and returns nothing, so the fake
kernel has nothing to compute: under torch.compile the mutations are known
from the schema's alias annotations. No autograd: an optimizer step is not
differentiated; it bumps the version counters of the tensors it writes and,
under grad mode, refuses to write one that requires grad."""
import torch

from ._common import check_one_device, register_mutating


@torch.library.register_fake("fusedops::adam_step")
def _adam_step_fake(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, master_params, steps,
                    lr, beta1, beta2, eps, weight_decay, decoupled_weight_decay, amsgrad, maximize,
                    lr_tensor=None, grad_scale=None, found_inf=None):
    check_one_device("adam_step", params=params, grads=grads, exp_avgs=exp_avgs,
                     exp_avg_sqs=exp_avg_sqs, max_exp_avg_sqs=max_exp_avg_sqs,
                     master_params=master_params, steps=steps, lr_tensor=lr_tensor,
                     grad_scale=grad_scale, found_inf=found_inf)
    return None


adam_step = register_mutating("adam_step")  # the op as fusedops calls it (_common.eager_call)
