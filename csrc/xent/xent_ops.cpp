// Registration shim for fusedops::xent_fwd / xent_bwd / xent_fwd_bwd_: checks
// the arguments, allocates outputs, fills the C params struct, calls the kernel.
#include "../common/shim.h"
#include "xent.h"

#include <tuple>

namespace fusedops {
namespace {

// logits [rows, vocab] (unit stride along vocab, else a contiguous copy) and
// target [rows] int64 on its device.
fo_xent_params xent_params(const char *op, Tensor &logits, const Tensor &target, int64_t ignore_index,
                           double label_smoothing, double softcap) {
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
  STD_TORCH_CHECK(label_smoothing >= 0.0 && label_smoothing <= 1.0, op, ": label_smoothing is ", label_smoothing,
                  ", expected a number in [0, 1]");
  STD_TORCH_CHECK(softcap >= 0.0 && softcap < INFINITY, op, ": softcap is ", softcap,
                  ", expected a finite number > 0, or 0 for none");
  p.smoothing = static_cast<float>(label_smoothing);
  p.softcap = static_cast<float>(softcap);
  // On the CPU the targets can be read here: one out of range is an error
  // (on a GPU that needs a sync; the kernel writes NaN loss there instead).
  if (logits.is_cpu()) {
    for (int64_t r = 0; r < p.rows; ++r)
      STD_TORCH_CHECK(fo_xent_class(&p, r) < p.vocab, op, ": target[", r, "] is ", p.target[r * p.t_stride],
                      ", expected a class in [0, ", p.vocab, ") or ignore_index (", ignore_index, ")");
  }
  return p;
}

// loss: the rows' losses ("none"), or their "mean" or "sum" (0-d) with
// count, the rows not ignored (0-d; [0] with "none"), which the gradient of
// the mean divides by.
std::tuple<Tensor, Tensor, Tensor> xent_fwd(Tensor logits, Tensor target, int64_t ignore_index,
                                            double label_smoothing, double softcap, StrArg reduction) {
  const char *op = "fusedops.xent_fwd";
  const std::string &red = reduction;
  STD_TORCH_CHECK(red == "none" || red == "mean" || red == "sum", op, ": reduction is '", red,
                  "', expected 'none', 'mean' or 'sum'");
  fo_xent_params p = xent_params(op, logits, target, ignore_index, label_smoothing, softcap);
  const bool reduced = red != "none";
  Tensor rows_loss = empty_1d(logits, p.rows, ScalarType::Float, op, "loss");
  Tensor lse = empty_1d(logits, p.rows, ScalarType::Float, op, "lse");
  Tensor loss = reduced ? new_output(logits, {}, ScalarType::Float, op, "loss") : rows_loss;
  Tensor count = reduced ? new_output(logits, {}, ScalarType::Float, op, "count")
                         : empty_1d(logits, 0, ScalarType::Float, op, "count");
  p.loss = static_cast<float *>(rows_loss.data_ptr());
  p.lse = static_cast<float *>(lse.data_ptr());
  fo_xent_reduce r{};
  if (reduced) {
    r.total = static_cast<float *>(loss.data_ptr());
    r.count = static_cast<float *>(count.data_ptr());
    r.mean = red == "mean";
  }
  if (p.rows > 0 || reduced)
    run_kernel(op, "logits", logits, [&] { return fo_xent_fwd_cpu(&p, &r); },
               [&](void *stream) { return fo_xent_fwd_cuda(&p, &r, stream); });
  return {loss, lse, count};
}

// A [rows] fp32 argument (a value a row of logits) on logits' device; with
// scalar_ok a 0-d one too (one value for every row).
void check_row_values(const char *op, const char *arg, const Tensor &t, const Tensor &logits, int64_t rows,
                      bool scalar_ok = false) {
  check_same_device(op, arg, t, logits, "logits");
  STD_TORCH_CHECK(t.scalar_type() == ScalarType::Float, op, ": ", arg, " has dtype ", dtype_name(t.scalar_type()),
                  ", expected float32");
  STD_TORCH_CHECK((t.dim() == 1 && t.size(0) == rows) || (scalar_ok && t.dim() == 0), op, ": ", arg, " has shape ",
                  shape_str(t), ", expected [", rows, "] (a value a row of logits)",
                  scalar_ok ? " or [] (the gradient of a mean or sum)" : "");
}

Tensor xent_bwd(Tensor dloss, Tensor logits, Tensor target, Tensor lse, int64_t ignore_index, double label_smoothing,
                double softcap, std::optional<Tensor> count) {
  const char *op = "fusedops.xent_bwd";
  fo_xent_params p = xent_params(op, logits, target, ignore_index, label_smoothing, softcap);
  check_row_values(op, "dloss", dloss, logits, p.rows, true);
  check_row_values(op, "lse", lse, logits, p.rows);
  fo_xent_reduce r{};
  if (count) {
    check_same_device(op, "count", *count, logits, "logits");
    STD_TORCH_CHECK(count->scalar_type() == ScalarType::Float && count->dim() == 0, op, ": count has dtype ",
                    dtype_name(count->scalar_type()), " and shape ", shape_str(*count),
                    ", expected a float32 [] (xent_fwd's count of a mean)");
    r.count_in = static_cast<const float *>(count->data_ptr());
  }
  lse = unit_last(lse, op, "lse");
  Tensor dlogits = new_output(logits, {p.rows, p.vocab}, logits.scalar_type(), op, "dlogits");
  p.dloss = static_cast<const float *>(dloss.data_ptr());
  p.g_stride = dloss.dim() ? dloss.stride(0) : 0;
  p.lse_in = static_cast<const float *>(lse.data_ptr());
  p.dlogits = dlogits.data_ptr();
  p.d_stride = p.vocab;
  if (p.rows > 0)
    run_kernel(op, "logits", logits, [&] { return fo_xent_bwd_cpu(&p, &r); },
               [&](void *stream) { return fo_xent_bwd_cuda(&p, &r, stream); });
  return dlogits;
}

// The loss of each row, and the gradient of sum_r dloss_r loss_r written over
// the logits (xent.h's fused pass).
Tensor xent_fwd_bwd_(Tensor logits, Tensor target, Tensor dloss, int64_t ignore_index, double label_smoothing,
                     double softcap) {
  const char *op = "fusedops.xent_fwd_bwd_";
  STD_TORCH_CHECK(logits.dim() != 2 || is_unit_last(logits), op, ": logits has strides ", strides_str(logits),
                  ", expected unit stride along classes (the gradient is written over it)");
  Tensor written = logits;
  fo_xent_params p = xent_params(op, logits, target, ignore_index, label_smoothing, softcap);
  check_row_values(op, "dloss", dloss, logits, p.rows);
  check_no_aliasing(op, {{"logits", -1, &written, true}, {"target", -1, &target, false}, {"dloss", -1, &dloss, false}});
  Tensor loss = empty_1d(logits, p.rows, ScalarType::Float, op, "loss");
  p.loss = static_cast<float *>(loss.data_ptr());
  p.dloss = static_cast<const float *>(dloss.data_ptr());
  p.g_stride = dloss.stride(0);
  p.dlogits = logits.data_ptr();
  p.d_stride = p.x_stride;
  if (p.rows > 0)
    run_kernel(op, "logits", logits, [&] { return fo_xent_fwd_bwd_cpu(&p); },
               [&](void *stream) { return fo_xent_fwd_bwd_cuda(&p, stream); });
  return loss;
}

// grad *= dloss (one fp32 value on grad's device), nothing touched where it
// is 1: the backward of the fused linear cross-entropy (xent.h).
void linear_xent_scale_(Tensor grad, Tensor dloss) {
  const char *op = "fusedops.linear_xent_scale_";
  fo_xent_scale_params p{};
  p.dtype = kernel_dtype(op, "grad", grad);
  STD_TORCH_CHECK(grad.is_contiguous(), op, ": grad has strides ", strides_str(grad), ", expected contiguous");
  check_same_device(op, "dloss", dloss, grad, "grad");
  STD_TORCH_CHECK(dloss.scalar_type() == ScalarType::Float && dloss.numel() == 1, op, ": dloss has shape ",
                  shape_str(dloss), " and dtype ", dtype_name(dloss.scalar_type()),
                  ", expected one float32 value (the loss's gradient)");
  check_no_aliasing(op, {{"grad", -1, &grad, true}, {"dloss", -1, &dloss, false}});
  p.n = grad.numel();
  p.grad = grad.data_ptr();
  p.dloss = static_cast<const float *>(dloss.data_ptr());
  if (p.n > 0)
    run_kernel(op, "grad", grad, [&] { return fo_xent_scale_cpu(&p); },
               [&](void *stream) { return fo_xent_scale_cuda(&p, stream); });
}

}  // namespace
}  // namespace fusedops

STABLE_TORCH_LIBRARY_IMPL(fusedops, CPU, m) {
  m.impl("xent_fwd", TORCH_BOX(&fusedops::xent_fwd));
  m.impl("xent_bwd", TORCH_BOX(&fusedops::xent_bwd));
  m.impl("xent_fwd_bwd_", TORCH_BOX(&fusedops::xent_fwd_bwd_));
  m.impl("linear_xent_scale_", TORCH_BOX(&fusedops::linear_xent_scale_));
}

#ifdef FUSEDOPS_WITH_CUDA
STABLE_TORCH_LIBRARY_IMPL(fusedops, CUDA, m) {
  m.impl("xent_fwd", TORCH_BOX(&fusedops::xent_fwd));
  m.impl("xent_bwd", TORCH_BOX(&fusedops::xent_bwd));
  m.impl("xent_fwd_bwd_", TORCH_BOX(&fusedops::xent_fwd_bwd_));
  m.impl("linear_xent_scale_", TORCH_BOX(&fusedops::linear_xent_scale_));
}
#endif
