// Registration shim for fusedops::adam_step: checks the tensor lists, fills
// the C params struct (arrays of pointers and sizes), calls the kernel. The op
// mutates its state lists in place and returns nothing.
#include "../common/shim.h"
#include "adam.h"

#include <algorithm>
#include <utility>

namespace fusedops {
namespace {

using OptTensor = std::optional<Tensor>;
using TensorList = std::vector<Tensor>;
const char *kOp = "fusedops.adam_step";

std::string item(const char *list, size_t i) { return std::string(list) + "[" + std::to_string(i) + "]"; }

// Non-overlapping and dense: the elements fill numel() consecutive slots in
// some dimension order, so an elementwise kernel may walk them as one array.
bool dense(const Tensor &t) {
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size) of dims of size > 1
  for (int64_t d = 0; d < t.dim(); ++d)
    if (t.size(d) > 1) dims.emplace_back(t.stride(d), t.size(d));
  std::sort(dims.begin(), dims.end());
  int64_t expect = 1;
  for (auto [stride, size] : dims) {
    if (stride != expect) return false;
    expect *= size;
  }
  return true;
}

void check_strided(const std::string &arg, const Tensor &t) {
  STD_TORCH_CHECK(t.layout() == torch::headeronly::Layout::Strided, kOp, ": ", arg,
                  " is sparse (or another non-strided layout), expected a dense strided tensor");
}

// A state, grad or master tensor: on the param's device, the param's shape and
// strides (so that one walk over memory visits the same elements of both).
void check_like_param(const std::string &arg, const Tensor &t, const Tensor &param,
                      const std::string &param_arg) {
  check_strided(arg, t);
  check_same_device(kOp, arg.c_str(), t, param, param_arg.c_str());
  check_same_shape(kOp, arg.c_str(), t, param, param_arg.c_str());
  bool same = true;
  for (int64_t d = 0; d < t.dim(); ++d) same = same && (t.size(d) <= 1 || t.stride(d) == param.stride(d));
  STD_TORCH_CHECK(same, kOp, ": ", arg, " has other strides than ", param_arg,
                  ", expected the same memory layout");
}

void check_dtype(const std::string &arg, const Tensor &t, ScalarType want) {
  STD_TORCH_CHECK(t.scalar_type() == want, kOp, ": ", arg, " has dtype ",
                  dtype_name(t.scalar_type()), ", expected ", dtype_name(want));
}

void check_length(const char *arg, const TensorList &l, size_t want, const char *why) {
  STD_TORCH_CHECK(l.size() == want, kOp, ": ", arg, " has ", l.size(), " tensors, expected ", want,
                  why);
}

// A one-element fp32 tensor on the params' device (lr, grad_scale, found_inf, steps).
const float *scalar_arg(const std::string &arg, const Tensor &t, const Tensor &ref) {
  check_strided(arg, t);
  check_same_device(kOp, arg.c_str(), t, ref, "params[0]");
  check_dtype(arg, t, ScalarType::Float);
  STD_TORCH_CHECK(t.numel() == 1, kOp, ": ", arg, " has shape ", shape_str(t),
                  ", expected one element");
  return static_cast<const float *>(t.data_ptr());
}

void adam_step(TensorList params, TensorList grads, TensorList exp_avgs, TensorList exp_avg_sqs,
               TensorList max_exp_avg_sqs, TensorList master_params, TensorList steps, double lr,
               double beta1, double beta2, double eps, double weight_decay,
               bool decoupled_weight_decay, bool amsgrad, bool maximize, OptTensor lr_tensor,
               OptTensor grad_scale, OptTensor found_inf) {
  const size_t n = params.size();
  check_length("grads", grads, n, " (one per param)");
  check_length("exp_avgs", exp_avgs, n, " (one per param)");
  check_length("exp_avg_sqs", exp_avg_sqs, n, " (one per param)");
  check_length("steps", steps, n, " (one per param)");
  check_length("max_exp_avg_sqs", max_exp_avg_sqs, amsgrad ? n : 0,
               amsgrad ? " (one per param with amsgrad=True)" : " (amsgrad=False)");
  const bool master = !master_params.empty();
  if (master) check_length("master_params", master_params, n, " (one per param, or none)");
  if (n == 0) return;

  const Tensor &p0 = params[0];
  check_strided("params[0]", p0);
  const fo_dtype pt = kernel_dtype(kOp, "params[0]", p0);
  const Tensor &s0 = exp_avgs[0];
  const fo_dtype st = kernel_dtype(kOp, "exp_avgs[0]", s0);
  STD_TORCH_CHECK(s0.scalar_type() == p0.scalar_type() || s0.scalar_type() == ScalarType::Float,
                  kOp, ": exp_avgs[0] has dtype ", dtype_name(s0.scalar_type()),
                  ", expected the dtype of params[0] (", dtype_name(p0.scalar_type()), ") or float32");
  STD_TORCH_CHECK(!master || pt != FO_F32, kOp,
                  ": master_params were given for float32 params, expected none "
                  "(master weights are for float16 / bfloat16 params)");
  STD_TORCH_CHECK(!master || st == FO_F32, kOp, ": exp_avgs[0] has dtype ",
                  dtype_name(s0.scalar_type()), ", expected float32 (with master_params)");

  std::vector<void *> p(n), g(n), m(n), v(n), vmax(amsgrad ? n : 0);
  std::vector<float *> mp(master ? n : 0), step(n);
  std::vector<int64_t> numel(n);
  for (size_t i = 0; i < n; ++i) {
    const std::string pa = item("params", i);
    const Tensor &t = params[i];
    check_strided(pa, t);
    check_same_device(kOp, pa.c_str(), t, p0, "params[0]");
    check_dtype(pa, t, p0.scalar_type());
    STD_TORCH_CHECK(dense(t), kOp, ": ", pa, " has shape ", shape_str(t),
                    " and strides that overlap or leave gaps, expected a dense tensor");
    check_like_param(item("grads", i), grads[i], t, pa);
    check_dtype(item("grads", i), grads[i], p0.scalar_type());
    check_like_param(item("exp_avgs", i), exp_avgs[i], t, pa);
    check_dtype(item("exp_avgs", i), exp_avgs[i], s0.scalar_type());
    check_like_param(item("exp_avg_sqs", i), exp_avg_sqs[i], t, pa);
    check_dtype(item("exp_avg_sqs", i), exp_avg_sqs[i], s0.scalar_type());
    if (amsgrad) {
      check_like_param(item("max_exp_avg_sqs", i), max_exp_avg_sqs[i], t, pa);
      check_dtype(item("max_exp_avg_sqs", i), max_exp_avg_sqs[i], s0.scalar_type());
      vmax[i] = max_exp_avg_sqs[i].data_ptr();
    }
    if (master) {
      check_like_param(item("master_params", i), master_params[i], t, pa);
      check_dtype(item("master_params", i), master_params[i], ScalarType::Float);
      mp[i] = static_cast<float *>(master_params[i].data_ptr());
    }
    step[i] = const_cast<float *>(scalar_arg(item("steps", i), steps[i], p0));
    p[i] = t.data_ptr();
    g[i] = grads[i].data_ptr();
    m[i] = exp_avgs[i].data_ptr();
    v[i] = exp_avg_sqs[i].data_ptr();
    numel[i] = t.numel();
  }

  fo_adam_params a{};
  a.ntensors = static_cast<int64_t>(n);
  a.params = p.data();
  a.grads = g.data();
  a.exp_avgs = m.data();
  a.exp_avg_sqs = v.data();
  a.max_exp_avg_sqs = amsgrad ? vmax.data() : nullptr;
  a.masters = master ? mp.data() : nullptr;
  a.steps = step.data();
  a.numels = numel.data();
  a.lr_ptr = lr_tensor ? scalar_arg("lr_tensor", *lr_tensor, p0) : nullptr;
  a.grad_scale = grad_scale ? scalar_arg("grad_scale", *grad_scale, p0) : nullptr;
  a.found_inf = found_inf ? scalar_arg("found_inf", *found_inf, p0) : nullptr;
  a.lr = lr;
  a.beta1 = beta1;
  a.beta2 = beta2;
  a.eps = eps;
  a.weight_decay = weight_decay;
  a.decoupled_weight_decay = decoupled_weight_decay;
  a.amsgrad = amsgrad;
  a.maximize = maximize;
  a.param_dtype = pt;
  a.state_dtype = st;

  // Every tensor the step writes, against every tensor it takes (grads and
  // the scalars are read while other tensors are being written).
  std::vector<AliasArg> args;
  auto add = [&](const char *list, const TensorList &l, bool written) {
    for (size_t i = 0; i < l.size(); ++i) args.push_back({list, static_cast<int64_t>(i), &l[i], written});
  };
  add("params", params, true);
  add("grads", grads, false);
  add("exp_avgs", exp_avgs, true);
  add("exp_avg_sqs", exp_avg_sqs, true);
  add("max_exp_avg_sqs", max_exp_avg_sqs, true);
  add("master_params", master_params, true);
  add("steps", steps, true);
  for (auto [name, t] : {std::pair{"lr_tensor", &lr_tensor}, {"grad_scale", &grad_scale}, {"found_inf", &found_inf}})
    if (*t) args.push_back({name, -1, &**t, false});
  check_no_aliasing(kOp, args);

  run_kernel(kOp, "params[0]", p0, [&] { return fo_adam_cpu(&a); },
             [&](void *stream) { return fo_adam_cuda(&a, stream); });
}

}  // namespace
}  // namespace fusedops

// Also for the sparse keys, so that a sparse tensor in a list gets the op's
// own message instead of the dispatcher's "could not run ... SparseCPU".
STABLE_TORCH_LIBRARY_IMPL(fusedops, CPU, m) { m.impl("adam_step", TORCH_BOX(&fusedops::adam_step)); }
STABLE_TORCH_LIBRARY_IMPL(fusedops, SparseCPU, m) { m.impl("adam_step", TORCH_BOX(&fusedops::adam_step)); }

#ifdef FUSEDOPS_WITH_CUDA
STABLE_TORCH_LIBRARY_IMPL(fusedops, CUDA, m) { m.impl("adam_step", TORCH_BOX(&fusedops::adam_step)); }
STABLE_TORCH_LIBRARY_IMPL(fusedops, SparseCUDA, m) { m.impl("adam_step", TORCH_BOX(&fusedops::adam_step)); }
#endif
