// Registration shim for fusedops::add_norm_fwd / add_norm_bwd: checks the
// arguments, allocates outputs, fills the C params struct, calls the kernel.
#include "../common/shim.h"
#include "norm.h"

#include <tuple>

namespace fusedops {
namespace {

using OptTensor = std::optional<Tensor>;

// weight / bias: [cols], in x's dtype or fp32, on x's device; both in one dtype.
void check_params(const char *op, const Tensor &x, OptTensor &weight, OptTensor &bias,
                  int64_t cols) {
  const ScalarType xt = x.scalar_type();
  if (weight) {
    check_same_device(op, "weight", *weight, x, "x");
    check_dtype_in(op, "weight", *weight, xt, ScalarType::Float, "the dtype of x or float32");
    weight = vector_arg(op, "weight", *weight, cols);
  }
  if (bias) {
    check_same_device(op, "bias", *bias, x, "x");
    check_dtype_in(op, "bias", *bias, xt, ScalarType::Float, "the dtype of x or float32");
    bias = vector_arg(op, "bias", *bias, cols);
  }
  if (weight && bias) {
    STD_TORCH_CHECK(weight->scalar_type() == bias->scalar_type(), op, ": bias has dtype ",
                    dtype_name(bias->scalar_type()), ", expected the dtype of weight (",
                    dtype_name(weight->scalar_type()), ")");
  }
}

std::tuple<Tensor, Tensor, Tensor, Tensor> add_norm_fwd(Tensor x, OptTensor residual,
                                                        OptTensor weight, OptTensor bias,
                                                        double eps, bool rms,
                                                        bool residual_in_fp32, bool stats) {
  const char *op = "fusedops.add_norm_fwd";
  STD_TORCH_CHECK(x.dim() >= 1, op, ": x has shape ", shape_str(x),
                  ", expected at least one dimension");
  const fo_dtype xt = kernel_dtype(op, "x", x);
  const int64_t cols = x.size(-1);
  if (residual) {
    check_same_device(op, "residual", *residual, x, "x");
    check_same_shape(op, "residual", *residual, x, "x");
    check_dtype_in(op, "residual", *residual, x.scalar_type(), ScalarType::Float,
                   "the dtype of x or float32");
  }
  check_params(op, x, weight, bias, cols);
  STD_TORCH_CHECK(!(rms && bias), op, ": bias was given, expected none for RMSNorm (rms=True)");

  const fo_dtype st = residual ? kernel_dtype(op, "residual", *residual)
                               : (residual_in_fp32 ? FO_F32 : xt);
  const bool store_s = residual || st != xt;
  const int64_t rows = numel_rows(x);

  Tensor y = empty_like_shape(x, x.scalar_type(), op, "y");
  Tensor s = store_s ? empty_like_shape(x, scalar_type_of(st), op, "s") : empty_1d(x, 0, x.scalar_type(), op, "s");
  Tensor mean = empty_1d(x, rms || !stats ? 0 : rows, ScalarType::Float, op, "mean");
  Tensor rstd = empty_1d(x, stats ? rows : 0, ScalarType::Float, op, "rstd");
  if (rows == 0) return {y, s, mean, rstd};

  RowView xv = row_view(x);
  RowView rv = residual ? row_view(*residual) : RowView{x, 0, 0, 0};

  fo_norm_fwd_params p{};
  p.rows = rows;
  p.cols = cols;
  p.x = xv.t.data_ptr();
  p.x_stride = xv.stride;
  p.residual = residual ? rv.t.data_ptr() : nullptr;
  p.res_stride = rv.stride;
  p.weight = weight ? weight->data_ptr() : nullptr;
  p.bias = bias ? bias->data_ptr() : nullptr;
  p.y = y.data_ptr();
  p.s = store_s ? s.data_ptr() : nullptr;
  p.mean = rms || !stats ? nullptr : static_cast<float *>(mean.data_ptr());
  p.rstd = stats ? static_cast<float *>(rstd.data_ptr()) : nullptr;
  p.eps = static_cast<float>(eps);
  p.rms = rms;
  p.x_dtype = xt;
  p.s_dtype = st;
  p.w_dtype = weight ? kernel_dtype(op, "weight", *weight)
                     : bias ? kernel_dtype(op, "bias", *bias) : xt;

  run_kernel(op, "x", x, [&] { return fo_norm_fwd_cpu(&p); },
             [&](void *stream) { return fo_norm_fwd_cuda(&p, stream); });
  return {y, s, mean, rstd};
}

std::tuple<Tensor, Tensor, Tensor> add_norm_bwd(Tensor dy, OptTensor ds, Tensor s,
                                                OptTensor weight, OptTensor bias, Tensor mean,
                                                Tensor rstd, bool rms, bool need_dweight,
                                                bool need_dbias) {
  const char *op = "fusedops.add_norm_bwd";
  STD_TORCH_CHECK(s.dim() >= 1, op, ": s has shape ", shape_str(s),
                  ", expected at least one dimension");
  const fo_dtype xt = kernel_dtype(op, "dy", dy);
  const fo_dtype st = kernel_dtype(op, "s", s);
  const int64_t cols = s.size(-1);
  const int64_t rows = numel_rows(s);
  check_same_device(op, "dy", dy, s, "s");
  check_same_shape(op, "dy", dy, s, "s");
  check_dtype_in(op, "s", s, dy.scalar_type(), ScalarType::Float, "the dtype of dy or float32");
  if (ds) {
    check_same_device(op, "ds", *ds, s, "s");
    check_same_shape(op, "ds", *ds, s, "s");
    check_dtype_in(op, "ds", *ds, s.scalar_type(), s.scalar_type(), dtype_name(s.scalar_type()));
  }
  check_params(op, dy, weight, bias, cols);
  STD_TORCH_CHECK(!need_dweight || weight, op, ": need_dweight=True but weight is None");
  STD_TORCH_CHECK(!need_dbias || bias, op, ": need_dbias=True but bias is None");
  for (const Tensor *t : {&mean, &rstd}) {
    const char *arg = t == &mean ? "mean" : "rstd";
    const int64_t want = (t == &mean && rms) ? 0 : rows;
    check_same_device(op, arg, *t, s, "s");
    check_dtype_in(op, arg, *t, ScalarType::Float, ScalarType::Float, "float32");
    STD_TORCH_CHECK(t->dim() == 1 && t->size(0) == want && (want <= 1 || t->stride(0) == 1), op,
                    ": ", arg, " has shape ", shape_str(*t), ", expected a contiguous [", want,
                    "]");
  }

  const ScalarType pt = weight ? weight->scalar_type() : bias ? bias->scalar_type() : dy.scalar_type();
  Tensor dx = empty_like_shape(s, s.scalar_type(), op, "dx");
  Tensor dw = empty_1d(s, need_dweight ? cols : 0, pt, op, "dweight");
  Tensor db = empty_1d(s, need_dbias ? cols : 0, pt, op, "dbias");

  fo_norm_bwd_params p{};
  p.rows = rows;
  p.cols = cols;
  p.rms = rms;
  p.x_dtype = xt;
  p.s_dtype = st;
  p.w_dtype = weight || bias ? kernel_dtype(op, "weight", weight ? *weight : *bias) : xt;
  p.dweight = need_dweight ? dw.data_ptr() : nullptr;
  p.dbias = need_dbias ? db.data_ptr() : nullptr;
  if (rows == 0 || cols == 0) {
    // Empty input: dweight / dbias are sums over no rows.
    if (need_dweight) torch::stable::zero_(dw);
    if (need_dbias) torch::stable::zero_(db);
    return {dx, dw, db};
  }

  RowView dyv = row_view(dy), sv = row_view(s);
  RowView dsv = ds ? row_view(*ds) : RowView{s, 0, 0, 0};
  p.dy = dyv.t.data_ptr();
  p.dy_stride = dyv.stride;
  p.ds = ds ? dsv.t.data_ptr() : nullptr;
  p.ds_stride = dsv.stride;
  p.s = sv.t.data_ptr();
  p.s_stride = sv.stride;
  p.weight = weight ? weight->data_ptr() : nullptr;
  p.mean = rms ? nullptr : static_cast<const float *>(mean.data_ptr());
  p.rstd = static_cast<const float *>(rstd.data_ptr());
  p.dx = dx.data_ptr();

  // dweight / dbias: partial rows, as many parts as the plan's kernel writes
  const bool need_partial = need_dweight || need_dbias;
  Tensor partial;
  auto with_parts = [&](int64_t parts) {
    p.parts = parts;
    partial = new_output(s, {2, parts, cols}, ScalarType::Float, op, "the dweight / dbias partial sums");
    p.partial = static_cast<float *>(partial.data_ptr());
  };
  run_kernel(op, "s", s,
             [&] {
               if (need_partial) with_parts(fo_norm_bwd_cpu_parts(&p));
               return fo_norm_bwd_cpu(&p);
             },
             [&](void *stream) {
               fo_norm_plan plan;
               if (const char *err = fo_norm_bwd_cuda_plan(&p, s.get_device_index(), &plan)) return err;
               if (need_partial) with_parts(plan.parts);
               return fo_norm_bwd_cuda(&p, &plan, stream);
             });
  return {dx, dw, db};
}

}  // namespace
}  // namespace fusedops

STABLE_TORCH_LIBRARY_IMPL(fusedops, CPU, m) {
  m.impl("add_norm_fwd", TORCH_BOX(&fusedops::add_norm_fwd));
  m.impl("add_norm_bwd", TORCH_BOX(&fusedops::add_norm_bwd));
}

#ifdef FUSEDOPS_WITH_CUDA
STABLE_TORCH_LIBRARY_IMPL(fusedops, CUDA, m) {
  m.impl("add_norm_fwd", TORCH_BOX(&fusedops::add_norm_fwd));
  m.impl("add_norm_bwd", TORCH_BOX(&fusedops::add_norm_bwd));
}
#endif
