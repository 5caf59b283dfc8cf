// Registration shim for fusedops::xent_fwd / xent_bwd: checks the arguments,
// allocates outputs, fills the C params struct, calls the kernel.
#include "../common/shim.h"
#include "xent.h"

#include <tuple>

namespace fusedops {
namespace {

// logits [rows, vocab] (unit stride along vocab, else a contiguous copy) and
// target [rows] int64 on its device.
fo_xent_params xent_params(const char *op, Tensor &logits, const Tensor &target, int64_t ignore_index) {
  STD_TORCH_CHECK(logits.dim() == 2, op, ": logits has shape ", shape_str(logits),
                  ", expected [rows, classes]");
  STD_TORCH_CHECK(logits.size(1) >= 1, op, ": logits has shape ", shape_str(logits),
                  ", expected at least one class");
  fo_xent_params p{};
  p.dtype = kernel_dtype(op, "logits", logits);
  check_same_device(op, "target", target, logits, "logits");
  STD_TORCH_CHECK(target.scalar_type() == ScalarType::Long, op, ": target has dtype ",
                  dtype_name(target.scalar_type()), ", expected int64 (class indices)");
  STD_TORCH_CHECK(target.dim() == 1 && target.size(0) == logits.size(0), op, ": target has shape ",
                  shape_str(target), ", expected [", logits.size(0), "] (a class index a row of logits)");
  logits = unit_last(logits, op, "logits");
  p.rows = logits.size(0);
  p.vocab = logits.size(1);
  p.logits = logits.data_ptr();
  p.x_stride = logits.stride(0);
  p.target = static_cast<const int64_t *>(target.data_ptr());
  p.t_stride = target.stride(0);
  p.ignore_index = ignore_index;
  // On the CPU the targets can be read here: one out of range is an error
  // (on a GPU that needs a sync; the kernel writes NaN loss there instead).
  if (logits.is_cpu()) {
    for (int64_t r = 0; r < p.rows; ++r)
      STD_TORCH_CHECK(fo_xent_class(&p, r) < p.vocab, op, ": target[", r, "] is ", p.target[r * p.t_stride],
                      ", expected a class in [0, ", p.vocab, ") or ignore_index (", ignore_index, ")");
  }
  return p;
}

std::tuple<Tensor, Tensor> xent_fwd(Tensor logits, Tensor target, int64_t ignore_index) {
  const char *op = "fusedops.xent_fwd";
  fo_xent_params p = xent_params(op, logits, target, ignore_index);
  Tensor loss = empty_1d(logits, p.rows, ScalarType::Float, op, "loss");
  Tensor lse = empty_1d(logits, p.rows, ScalarType::Float, op, "lse");
  p.loss = static_cast<float *>(loss.data_ptr());
  p.lse = static_cast<float *>(lse.data_ptr());
  if (p.rows > 0)
    run_kernel(op, "logits", logits, [&] { return fo_xent_fwd_cpu(&p); },
               [&](void *stream) { return fo_xent_fwd_cuda(&p, stream); });
  return {loss, lse};
}

Tensor xent_bwd(Tensor dloss, Tensor logits, Tensor target, Tensor lse, int64_t ignore_index) {
  const char *op = "fusedops.xent_bwd";
  fo_xent_params p = xent_params(op, logits, target, ignore_index);
  for (auto [arg, t] : {std::pair<const char *, const Tensor *>{"dloss", &dloss}, {"lse", &lse}}) {
    check_same_device(op, arg, *t, logits, "logits");
    STD_TORCH_CHECK(t->scalar_type() == ScalarType::Float, op, ": ", arg, " has dtype ",
                    dtype_name(t->scalar_type()), ", expected float32");
    STD_TORCH_CHECK(t->dim() == 1 && t->size(0) == p.rows, op, ": ", arg, " has shape ", shape_str(*t),
                    ", expected [", p.rows, "] (a value a row of logits)");
  }
  lse = unit_last(lse, op, "lse");
  Tensor dlogits = new_output(logits, {p.rows, p.vocab}, logits.scalar_type(), op, "dlogits");
  p.dloss = static_cast<const float *>(dloss.data_ptr());
  p.g_stride = dloss.stride(0);
  p.lse_in = static_cast<const float *>(lse.data_ptr());
  p.dlogits = dlogits.data_ptr();
  if (p.rows > 0)
    run_kernel(op, "logits", logits, [&] { return fo_xent_bwd_cpu(&p); },
               [&](void *stream) { return fo_xent_bwd_cuda(&p, stream); });
  return dlogits;
}

}  // namespace
}  // namespace fusedops

STABLE_TORCH_LIBRARY_IMPL(fusedops, CPU, m) {
  m.impl("xent_fwd", TORCH_BOX(&fusedops::xent_fwd));
  m.impl("xent_bwd", TORCH_BOX(&fusedops::xent_bwd));
}

#ifdef FUSEDOPS_WITH_CUDA
STABLE_TORCH_LIBRARY_IMPL(fusedops, CUDA, m) {
  m.impl("xent_fwd", TORCH_BOX(&fusedops::xent_fwd));
  m.impl("xent_bwd", TORCH_BOX(&fusedops::xent_bwd));
}
#endif
