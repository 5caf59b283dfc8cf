// Registration shim for fusedops::glu_fwd / glu_bwd / glu_bwd_recompute / glu_packed_fwd /
// glu_packed_bwd: checks the arguments, allocates outputs, fills the C params
// struct, calls the kernel.
#include "../common/shim.h"
#include "swiglu.h"

#include <string>
#include <tuple>
#include <initializer_list>
#include <utility>

namespace fusedops {
namespace {

fo_glu_act glu_act(const char *op, const std::string &activation) {
  if (activation == "silu") return FO_GLU_SILU;
  if (activation == "gelu_tanh") return FO_GLU_GELU_TANH;
  STD_TORCH_CHECK(false, op, ": activation is '", activation, "', expected 'silu' or 'gelu_tanh'");
  return FO_GLU_SILU;
}

// The row map of t's leading dims (two levels read in place; more: a copy,
// which `t` is replaced by).
fo_glu_rows glu_rows(const char *op, const char *arg, Tensor &t) {
  RowLevels lv = row_levels(t, 2);
  if (!lv.ok) {
    t = contiguous_copy(t, op, arg);
    lv = row_levels(t, 2);
  }
  const int64_t rows = numel_rows(t);
  if (lv.n == 0) return {rows, t.size(-1), 0};
  if (lv.n == 1) return {rows, lv.stride[0], 0};
  return {lv.size[0], lv.stride[0], lv.stride[1]};
}

void check_input(const char *op, const char *arg, const Tensor &t) {
  STD_TORCH_CHECK(t.dim() >= 1, op, ": ", arg, " has shape ", shape_str(t),
                  ", expected at least one dimension");
  kernel_dtype(op, arg, t);
}

void run(const char *op, const Tensor &like, const fo_glu_params &p, bool bwd) {
  if (p.rows == 0 || p.cols == 0) return;
  run_kernel(op, "the input", like,
             [&] { return bwd ? fo_glu_bwd_cpu(&p) : fo_glu_fwd_cpu(&p); },
             [&](void *stream) { return bwd ? fo_glu_bwd_cuda(&p, stream) : fo_glu_fwd_cuda(&p, stream); });
}

// Packed [gate | up] along the last dim: returns F, the width of each half.
int64_t packed_half(const char *op, const char *arg, const Tensor &t) {
  const int64_t w = t.size(-1);
  STD_TORCH_CHECK(w % 2 == 0, op, ": ", arg, " has shape ", shape_str(t),
                  ", expected an even last dimension ([gate | up] side by side)");
  return w / 2;
}

// The params of a call on separate gate and up (and dout), checked.
fo_glu_params glu_params(const char *op, Tensor &gate, Tensor &up, Tensor *dout,
                         const std::string &activation) {
  check_input(op, "gate", gate);
  check_like(op, "up", up, gate, "gate");
  check_same_shape(op, "up", up, gate, "gate");
  if (dout) {
    check_like(op, "dout", *dout, gate, "gate");
    check_same_shape(op, "dout", *dout, gate, "gate");
  }
  fo_glu_params p{};
  p.act = glu_act(op, activation);
  p.dtype = kernel_dtype(op, "gate", gate);
  p.rows = numel_rows(gate);
  p.cols = gate.size(-1);
  p.out_stride = p.cols;
  p.gate_rows = glu_rows(op, "gate", gate);
  p.up_rows = glu_rows(op, "up", up);
  p.gate = gate.data_ptr();
  p.up = up.data_ptr();
  if (dout) {
    p.dout_rows = glu_rows(op, "dout", *dout);
    p.dout = dout->data_ptr();
  }
  return p;
}

Tensor glu_fwd(Tensor gate, Tensor up, StrArg activation) {
  const char *op = "fusedops.glu_fwd";
  fo_glu_params p = glu_params(op, gate, up, nullptr, activation);
  Tensor out = empty_like_shape(gate, gate.scalar_type(), op, "out");
  p.out = out.data_ptr();
  run(op, gate, p, false);
  return out;
}

// The backward into new tensors; with `out`, also the forward's output
// act(gate) * up, recomputed, into out.
std::tuple<Tensor, Tensor> glu_bwd_into(const char *op, Tensor &dout, Tensor &gate, Tensor &up,
                                        const std::string &activation, Tensor *out) {
  fo_glu_params p = glu_params(op, gate, up, &dout, activation);
  Tensor dgate = empty_like_shape(gate, gate.scalar_type(), op, "dgate");
  Tensor dup = empty_like_shape(gate, gate.scalar_type(), op, "dup");
  p.dgate = dgate.data_ptr();
  p.dup = dup.data_ptr();
  if (out) {
    *out = empty_like_shape(gate, gate.scalar_type(), op, "out");
    p.out = out->data_ptr();
    p.h_stride = p.cols;
  }
  run(op, gate, p, true);
  return {dgate, dup};
}

std::tuple<Tensor, Tensor> glu_bwd(Tensor dout, Tensor gate, Tensor up, StrArg activation) {
  return glu_bwd_into("fusedops.glu_bwd", dout, gate, up, activation, nullptr);
}

// glu_bwd_'s results in new tensors (for torch.compile, which copies a
// backward graph's inputs before an op writes them).
std::tuple<Tensor, Tensor, Tensor> glu_bwd_recompute(Tensor dout, Tensor gate, Tensor up,
                                                     StrArg activation) {
  Tensor out = dout;
  auto [dgate, dup] = glu_bwd_into("fusedops.glu_bwd_recompute", dout, gate, up, activation, &out);
  return {out, dgate, dup};
}

// The in-place backward ops write every tensor they take: each must be
// contiguous (the kernel reads and writes it as rows of one stride), and no
// two may share memory (each element is read, then written with another
// result: a shared one would end up holding either).
void check_overwritable(const char *op, std::initializer_list<std::pair<const char *, const Tensor *>> ts) {
  std::vector<AliasArg> args;
  for (const auto &[arg, t] : ts) {
    STD_TORCH_CHECK(t->is_contiguous(), op, ": ", arg,
                    " is not contiguous, expected a contiguous tensor (it is written in place)");
    args.push_back({arg, -1, t, true});
  }
  check_no_aliasing(op, args);
}

// In place, for a caller that has no further use for its inputs
// (fusedops.functional.glu_mlp's backward): dgate over gate, dup over up, and
// the forward's output act(gate) * up over dout (all three dense).
void glu_bwd_(Tensor dout, Tensor gate, Tensor up, StrArg activation) {
  const char *op = "fusedops.glu_bwd_";
  check_overwritable(op, {{"dout", &dout}, {"gate", &gate}, {"up", &up}});
  fo_glu_params p = glu_params(op, gate, up, &dout, activation);
  p.dgate = gate.data_ptr();
  p.dup = up.data_ptr();
  p.out = dout.data_ptr();
  p.h_stride = p.cols;
  run(op, gate, p, true);
}

// The params of a call on packed [gate | up] (and dout), checked; `half` is
// gate_up's shape with the last dim halved (the shape of out and dout).
fo_glu_params packed_params(const char *op, Tensor &gate_up, Tensor *dout,
                            const std::string &activation, std::vector<int64_t> &half) {
  check_input(op, "gate_up", gate_up);
  fo_glu_params p{};
  p.act = glu_act(op, activation);
  p.dtype = kernel_dtype(op, "gate_up", gate_up);
  p.cols = packed_half(op, "gate_up", gate_up);
  p.rows = numel_rows(gate_up);
  half = sizes_of(gate_up);
  half.back() = p.cols;
  if (dout) {
    check_like(op, "dout", *dout, gate_up, "gate_up");
    bool same = dout->dim() == gate_up.dim();
    for (int64_t d = 0; same && d < dout->dim(); ++d) same = dout->size(d) == half[d];
    STD_TORCH_CHECK(same, op, ": dout has shape ", shape_str(*dout),
                    ", expected gate_up's shape with the last dimension halved");
    p.dout_rows = glu_rows(op, "dout", *dout);
    p.dout = dout->data_ptr();
  }
  p.gate_rows = p.up_rows = glu_rows(op, "gate_up", gate_up);
  p.gate = gate_up.data_ptr();
  p.up = static_cast<const char *>(p.gate) + p.cols * fo_dtype_size(p.dtype);
  return p;
}

Tensor glu_packed_fwd(Tensor gate_up, StrArg activation) {
  const char *op = "fusedops.glu_packed_fwd";
  std::vector<int64_t> half;
  fo_glu_params p = packed_params(op, gate_up, nullptr, activation, half);
  Tensor out = new_output(gate_up, half, gate_up.scalar_type(), op, "out");
  p.out = out.data_ptr();
  p.out_stride = p.cols;
  run(op, gate_up, p, false);
  return out;
}

// dgate_up: [dgate | dup] side by side, rows of 2 cols.
Tensor glu_packed_bwd(Tensor dout, Tensor gate_up, StrArg activation) {
  const char *op = "fusedops.glu_packed_bwd";
  std::vector<int64_t> half;
  fo_glu_params p = packed_params(op, gate_up, &dout, activation, half);
  Tensor dgate_up = empty_like_shape(gate_up, gate_up.scalar_type(), op, "dgate_up");
  p.dgate = dgate_up.data_ptr();
  p.dup = static_cast<char *>(p.dgate) + p.cols * fo_dtype_size(p.dtype);
  p.out_stride = 2 * p.cols;
  run(op, gate_up, p, true);
  return dgate_up;
}

// glu_packed_bwd in place: [dgate | dup] over gate_up, act(gate) * up over
// dout (both dense).
void glu_packed_bwd_(Tensor dout, Tensor gate_up, StrArg activation) {
  const char *op = "fusedops.glu_packed_bwd_";
  check_overwritable(op, {{"dout", &dout}, {"gate_up", &gate_up}});
  std::vector<int64_t> half;
  fo_glu_params p = packed_params(op, gate_up, &dout, activation, half);
  p.dgate = gate_up.data_ptr();
  p.dup = static_cast<char *>(p.dgate) + p.cols * fo_dtype_size(p.dtype);
  p.out_stride = 2 * p.cols;
  p.out = dout.data_ptr();
  p.h_stride = p.cols;
  run(op, gate_up, p, true);
}

}  // namespace
}  // namespace fusedops

STABLE_TORCH_LIBRARY_IMPL(fusedops, CPU, m) {
  m.impl("glu_fwd", TORCH_BOX(&fusedops::glu_fwd));
  m.impl("glu_bwd", TORCH_BOX(&fusedops::glu_bwd));
  m.impl("glu_bwd_", TORCH_BOX(&fusedops::glu_bwd_));
  m.impl("glu_bwd_recompute", TORCH_BOX(&fusedops::glu_bwd_recompute));
  m.impl("glu_packed_fwd", TORCH_BOX(&fusedops::glu_packed_fwd));
  m.impl("glu_packed_bwd", TORCH_BOX(&fusedops::glu_packed_bwd));
  m.impl("glu_packed_bwd_", TORCH_BOX(&fusedops::glu_packed_bwd_));
}

#ifdef FUSEDOPS_WITH_CUDA
STABLE_TORCH_LIBRARY_IMPL(fusedops, CUDA, m) {
  m.impl("glu_fwd", TORCH_BOX(&fusedops::glu_fwd));
  m.impl("glu_bwd", TORCH_BOX(&fusedops::glu_bwd));
  m.impl("glu_bwd_", TORCH_BOX(&fusedops::glu_bwd_));
  m.impl("glu_bwd_recompute", TORCH_BOX(&fusedops::glu_bwd_recompute));
  m.impl("glu_packed_fwd", TORCH_BOX(&fusedops::glu_packed_fwd));
  m.impl("glu_packed_bwd", TORCH_BOX(&fusedops::glu_packed_bwd));
  m.impl("glu_packed_bwd_", TORCH_BOX(&fusedops::glu_packed_bwd_));
}
#endif
