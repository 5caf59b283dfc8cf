"""Fake kernel for fusedops::adam_step.

Schema (csrc/library.cpp):
  adam_step(params!, grads, exp_avgs!, exp_avg_sqs!, max_exp_avg_sqs!, master_params!,
            steps!, lr, beta1, beta2, eps, weight_decay, decoupled_weight_decay,
            amsgrad, maximize, lr_tensor?, grad_scale?, found_inf?) -> ()

The op updates its mutable lists in place and returns nothing, so the fake
kernel has nothing to compute: under torch.compile the mutations are known
from the schema's alias annotations. No autograd: an optimizer step is not
differentiated."""
import torch


@torch.library.register_fake("fusedops::adam_step")
def _adam_step_fake(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, master_params, steps,
                    lr, beta1, beta2, eps, weight_decay, decoupled_weight_decay, amsgrad, maximize,
                    lr_tensor=None, grad_scale=None, found_inf=None):
    return None
