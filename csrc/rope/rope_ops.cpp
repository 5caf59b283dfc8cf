// Registration shim for fusedops::rope: checks the arguments, allocates the
// outputs (the layout: out_like), fills the C params struct, calls the kernel.
#include "../common/shim.h"
#include "rope.h"

#include <tuple>

namespace fusedops {
namespace {

void check_qk(const char *op, const char *arg, const Tensor &t, const Tensor &q) {
  STD_TORCH_CHECK(t.dim() == 4, op, ": ", arg, " has shape ", shape_str(t),
                  ", expected 4 dimensions [batch, heads, seq, head_dim]");
  if (&t == &q) {
    STD_TORCH_CHECK(t.size(3) % 2 == 0, op, ": q has shape ", shape_str(t),
                    ", expected an even head_dim (its halves are rotated against each other)");
    return;
  }
  check_like(op, arg, t, q, "q");
  STD_TORCH_CHECK(t.size(0) == q.size(0) && t.size(2) == q.size(2) && t.size(3) == q.size(3), op,
                  ": ", arg, " has shape ", shape_str(t), ", expected q's batch, seq and head_dim (q has shape ",
                  shape_str(q), ")");
}

void check_table(const char *op, const char *arg, const Tensor &t, const Tensor &q) {
  check_like(op, arg, t, q, "q");
  STD_TORCH_CHECK(t.dim() == 3 && (t.size(0) == 1 || t.size(0) == q.size(0)) && t.size(1) == q.size(2) &&
                      t.size(2) == q.size(3),
                  op, ": ", arg, " has shape ", shape_str(t), ", expected [", q.size(0), " or 1, ", q.size(2),
                  ", ", q.size(3), "] ([batch, seq, head_dim] of q, shape ", shape_str(q), ")");
}

// A [B, H, S, D] output. The forward rotation's is contiguous (the attention
// reads either layout in place; this layout made the e2e Llama step faster,
// for a reason not identified: docs/perf/rope.md). The
// inverse's (the backward's, on output gradients) is [B, S, H, D] in memory:
// the layout of the projections the gradients flow back into, which then
// takes no copy.
Tensor out_like(const char *op, const char *name, const Tensor &x, bool inverse) {
  if (!inverse) return new_output(x, {x.size(0), x.size(1), x.size(2), x.size(3)}, x.scalar_type(), op, name);
  Tensor o = new_output(x, {x.size(0), x.size(2), x.size(1), x.size(3)}, x.scalar_type(), op, name);
  return torch::stable::transpose(o, 1, 2);
}

fo_rope_tensor rope_tensor(const Tensor &x, const Tensor &o) {
  return {x.data_ptr(), o.data_ptr(), x.size(1), x.stride(0), x.stride(1), x.stride(2),
          o.stride(0),  o.stride(1),  o.stride(2)};
}

void check_args(const char *op, const Tensor &q, const Tensor &k, const Tensor &cos, const Tensor &sin) {
  kernel_dtype(op, "q", q);
  check_qk(op, "q", q, q);
  check_qk(op, "k", k, q);
  check_table(op, "cos", cos, q);
  check_table(op, "sin", sin, q);
}

// Rotates q into qo and k into ko (which may be q and k themselves).
void run(const char *op, const Tensor &q, const Tensor &k, Tensor cos, Tensor sin, bool inverse,
         const Tensor &qo, const Tensor &ko) {
  cos = unit_last(cos, op, "cos"), sin = unit_last(sin, op, "sin");
  fo_rope_params p{};
  p.t[0] = rope_tensor(q, qo);
  p.t[1] = rope_tensor(k, ko);
  p.n_tensors = 2;
  p.batch = q.size(0), p.seq = q.size(2), p.dim = q.size(3);
  p.cos = cos.data_ptr(), p.sin = sin.data_ptr();
  p.cb = cos.size(0) == 1 ? 0 : cos.stride(0), p.cs = cos.stride(1);
  p.sb = sin.size(0) == 1 ? 0 : sin.stride(0), p.ss = sin.stride(1);
  p.inverse = inverse;
  p.dtype = kernel_dtype(op, "q", q);
  if (p.batch == 0 || p.seq == 0 || p.dim == 0 || q.size(1) + k.size(1) == 0) return;
  run_kernel(op, "q", q, [&] { return fo_rope_cpu(&p); },
             [&](void *stream) { return fo_rope_cuda(&p, stream); });
}

std::tuple<Tensor, Tensor> rope(Tensor q, Tensor k, Tensor cos, Tensor sin, bool inverse) {
  const char *op = "fusedops.rope";
  check_args(op, q, k, cos, sin);
  q = unit_last(q, op, "q"), k = unit_last(k, op, "k");
  Tensor qo = out_like(op, "the rotated q", q, inverse), ko = out_like(op, "the rotated k", k, inverse);
  run(op, q, k, cos, sin, inverse, qo, ko);
  return {qo, ko};
}

void rope_(Tensor q, Tensor k, Tensor cos, Tensor sin, bool inverse) {
  const char *op = "fusedops.rope_";
  check_args(op, q, k, cos, sin);
  for (const Tensor *t : {&q, &k})
    STD_TORCH_CHECK(is_unit_last(*t), op, ": ", t == &q ? "q" : "k", " has strides ",
                    strides_str(*t), ", expected unit stride along head_dim (the last dimension) to rotate it in place");
  check_no_aliasing(op, {{"q", -1, &q, true}, {"k", -1, &k, true}, {"cos", -1, &cos, false},
                         {"sin", -1, &sin, false}});
  run(op, q, k, cos, sin, inverse, q, k);
}

}  // namespace
}  // namespace fusedops

STABLE_TORCH_LIBRARY_IMPL(fusedops, CPU, m) {
  m.impl("rope", TORCH_BOX(&fusedops::rope));
  m.impl("rope_", TORCH_BOX(&fusedops::rope_));
}

#ifdef FUSEDOPS_WITH_CUDA
STABLE_TORCH_LIBRARY_IMPL(fusedops, CUDA, m) {
  m.impl("rope", TORCH_BOX(&fusedops::rope));
  m.impl("rope_", TORCH_BOX(&fusedops::rope_));
}
#endif
