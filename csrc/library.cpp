// Every fusedops op schema, in one place: this file is the library's API.
// Implementations register per device in csrc/<op>/<op>_ops.cpp.
#include <torch/csrc/stable/library.h>

STABLE_TORCH_LIBRARY(fusedops, m) {
  // Residual-add + LayerNorm / RMSNorm (csrc/norm). s = x + residual in
  // residual's dtype (or fp32 when residual is None and residual_in_fp32);
  // y = norm(s) in x's dtype. s is empty when it equals x; mean is empty for
  // RMSNorm; mean and rstd are fp32 per row, for the backward: with
  // stats=False (no gradient wanted) both are empty and neither is written.
  m.def("add_norm_fwd(Tensor x, Tensor? residual, Tensor? weight, Tensor? bias, float eps, "
        "bool rms, bool residual_in_fp32, bool stats=True) -> (Tensor y, Tensor s, Tensor mean, Tensor rstd)");
  // Gradient of add_norm_fwd. s is the normalised input (x when s was not
  // stored). dx, in s's dtype, is the gradient of both x and residual, ds
  // included. dweight / dbias are empty unless asked for.
  m.def("add_norm_bwd(Tensor dy, Tensor? ds, Tensor s, Tensor? weight, Tensor? bias, "
        "Tensor mean, Tensor rstd, bool rms, bool need_dweight, bool need_dbias) "
        "-> (Tensor dx, Tensor dweight, Tensor dbias)");
  // Gated linear units (csrc/swiglu): out = act(gate) * up, activation "silu"
  // (SwiGLU) or "gelu_tanh" (GeGLU). Backward recomputes act from gate. The
  // packed forms take one [..., 2F] tensor holding [gate | up] and give an
  // [..., F] output; their gradient is one [..., 2F] tensor.
  m.def("glu_fwd(Tensor gate, Tensor up, str activation) -> Tensor");
  m.def("glu_bwd(Tensor dout, Tensor gate, Tensor up, str activation) -> (Tensor dgate, Tensor dup)");
  // glu_bwd writing dgate over gate, dup over up, and the forward's output
  // act(gate) * up over dout (all contiguous).
  m.def("glu_bwd_(Tensor(a!) dout, Tensor(b!) gate, Tensor(c!) up, str activation) -> ()");
  // glu_bwd_'s three results as new tensors: (out, dgate, dup).
  m.def("glu_bwd_recompute(Tensor dout, Tensor gate, Tensor up, str activation) -> (Tensor out, Tensor dgate, Tensor dup)");
  m.def("glu_packed_fwd(Tensor gate_up, str activation) -> Tensor");
  m.def("glu_packed_bwd(Tensor dout, Tensor gate_up, str activation) -> Tensor");
  // glu_packed_bwd writing [dgate | dup] over gate_up and act(gate) * up over
  // dout (both contiguous).
  m.def("glu_packed_bwd_(Tensor(a!) dout, Tensor(b!) gate_up, str activation) -> ()");
  // Cross-entropy (csrc/xent) of logits [rows, classes] (fp32, fp16 or bf16)
  // against class indices target [rows] (int64): loss [rows] fp32, lse - the
  // target's logit (0 where target == ignore_index), and lse [rows] fp32 (the
  // natural-log logsumexp of each row, for the backward). xent_bwd: dlogits =
  // dloss (softmax - onehot(target)) row by row, in logits' dtype, 0 on ignored
  // rows; dloss [rows] fp32, any stride (0: one value for all).
  // label_smoothing e mixes the one-hot target with e / classes everywhere;
  // softcap c > 0 reads every logit x as c tanh(x / c) (Gemma 2's final layer).
  // reduction "mean" or "sum": loss is the rows' mean or sum (0-d), reduced
  // in the kernel, and count (0-d fp32) the rows not ignored; "none": loss
  // [rows] and count empty. xent_bwd takes a 0-d dloss (a reduced loss's) for
  // every row, divided by the forward's count where one is given (a mean).
  m.def("xent_fwd(Tensor logits, Tensor target, int ignore_index, float label_smoothing=0.0, "
        "float softcap=0.0, str reduction=\"none\") -> (Tensor loss, Tensor lse, Tensor count)");
  m.def("xent_bwd(Tensor dloss, Tensor logits, Tensor target, Tensor lse, int ignore_index, "
        "float label_smoothing=0.0, float softcap=0.0, Tensor? count=None) -> Tensor");
  // xent_fwd's loss, and xent_bwd's dlogits (of dloss, [rows] fp32, any
  // stride) written over logits (unit stride along classes) in the same pass:
  // the fused linear cross-entropy's step on a chunk of logits.
  m.def("xent_fwd_bwd_(Tensor(a!) logits, Tensor target, Tensor dloss, int ignore_index, "
        "float label_smoothing=0.0, float softcap=0.0) -> Tensor loss");
  // Fused linear cross-entropy: cross_entropy(input @ weight^T + bias, target)
  // of input [rows, hidden] and weight [classes, hidden] (one dtype: fp32,
  // fp16 or bf16; bias [classes] or None) without the [rows, classes] logits,
  // a chunk of rows at a time (fusedops/ops/linear_xent.py: the matmuls are
  // torch's, the loss and its gradient xent_fwd_bwd_). loss is fp32: [rows]
  // with reduction "none", else a scalar. With "mean" or "sum" the gradients
  // of the loss flagged by input_grad / weight_grad / bias_grad come out of
  // the same pass (empty where not flagged: the backward scales them); with
  // "none" they are empty, and linear_xent_bwd recomputes the chunks' logits
  // for the gradient of sum_r dloss_r loss_r. num_items (one number, any
  // device): the mean's divisor instead of the count of targets that are not
  // ignore_index (Hugging Face's num_items_in_batch), so that the gradients
  // come out of the forward for it too.
  m.def("linear_xent_fwd(Tensor input, Tensor weight, Tensor? bias, Tensor target, int ignore_index, "
        "str reduction, float label_smoothing, float softcap, bool input_grad, bool weight_grad, "
        "bool bias_grad, Tensor? num_items=None) -> (Tensor loss, Tensor dinput, Tensor dweight, Tensor dbias)");
  m.def("linear_xent_bwd(Tensor dloss, Tensor input, Tensor weight, Tensor? bias, Tensor target, "
        "int ignore_index, float label_smoothing, float softcap, bool input_grad, bool weight_grad, "
        "bool bias_grad) -> (Tensor dinput, Tensor dweight, Tensor dbias)");
  // linear_xent_fwd's backward with "mean" or "sum": a gradient it handed out
  // (contiguous) times the loss's (dloss, one fp32 value), read on the
  // device; nothing read or written where dloss is 1 (csrc/xent/xent.h).
  m.def("linear_xent_scale_(Tensor(a!) grad, Tensor dloss) -> ()");
  // Attention (csrc/attention): out = softmax(scale * q k^T) v on [batch, seq,
  // heads, head_dim] tensors read through their strides (last dim unit-stride;
  // (B, H, S, D)-transposed views need no copy). k and v have Hkv heads, Hq a
  // multiple of Hkv (grouped-query). out is contiguous [B, Sq, Hq, D] in q's
  // dtype, lse fp32 [B, Hq, Sq] (natural log). deterministic is not used by the
  // forward: it is recorded for the backward (fusedops/ops/attention.py).
  // Masks (csrc/attention/attention.h): query i sees keys j with
  //   i - window_left <= j <= i + window_right   (-1: that side unbounded),
  // aligned top-left (as torch SDPA's is_causal: tril(ones(Sq, Sk))); causal
  // is window_right = 0 (and overrides it). A row that sees no key gives out 0,
  // lse -inf. softcap > 0 replaces each scaled score s by softcap tanh(s / softcap).
  m.def("attn_fwd(Tensor q, Tensor k, Tensor v, float scale, bool causal, bool deterministic=False, "
        "int window_left=-1, int window_right=-1, float softcap=0.0) -> (Tensor out, Tensor lse)");
  // Gradient of attn_fwd from out and lse; dq, dk, dv contiguous, shaped as
  // q, k, v. deterministic: bitwise-repeatable results.
  m.def("attn_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
        "float scale, bool causal, bool deterministic, int window_left=-1, int window_right=-1, "
        "float softcap=0.0) -> (Tensor dq, Tensor dk, Tensor dv)");
  // attn_bwd for Sq = Sk, its three gradients side by side in one tensor
  // [B, S, Hq + 2 Hkv, D] (dq's heads, then dk's, then dv's): the gradient of
  // a joint q / k / v projection's output (fusedops.functional.qkv_attention).
  m.def("attn_bwd_packed(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
        "float scale, bool causal, bool deterministic, int window_left=-1, int window_right=-1, "
        "float softcap=0.0) -> Tensor dqkv");
  // Packed sequences (varlen), as FlashAttention's varlen functions: q
  // [total_q, Hq, D], k and v [total_k, Hkv, D]; sequence b has queries
  // cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1 and keys likewise (int32 prefix
  // sums, batch + 1 values, on q's device); max_seqlen_* bound the sequences'
  // lengths. No attention crosses a sequence; within one, the mask is aligned
  // bottom-right (the last query sees the last key: diag = Sk - Sq). out as q,
  // lse fp32 [Hq, total_q].
  m.def("attn_varlen_fwd(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
        "int max_seqlen_q, int max_seqlen_k, float scale, bool causal, bool deterministic=False, "
        "int window_left=-1, int window_right=-1, float softcap=0.0) -> (Tensor out, Tensor lse)");
  m.def("attn_varlen_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
        "Tensor cu_seqlens_q, Tensor cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, float scale, "
        "bool causal, bool deterministic, int window_left=-1, int window_right=-1, float softcap=0.0) "
        "-> (Tensor dq, Tensor dk, Tensor dv)");
  // Rotary position embedding of q and k (csrc/rope), the rotate-half layout
  // (Hugging Face's apply_rotary_pos_emb): q [B, Hq, S, D] and k [B, Hk, S, D]
  // read through their strides, cos and sin [B or 1, S, D] in q's dtype.
  // Outputs shaped as q and k: contiguous, or with inverse (the transposed
  // rotation, which maps output gradients to input gradients) [B, S, H, D] in
  // memory, the layout of the projections the gradients flow into.
  m.def("rope(Tensor q, Tensor k, Tensor cos, Tensor sin, bool inverse=False) -> (Tensor q_out, Tensor k_out)");
  // rope in place: q and k overwritten by their rotation (unit stride along
  // head_dim; no other layout requirement).
  m.def("rope_(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin, bool inverse=False) -> ()");
  // Multi-tensor Adam / AdamW (csrc/adam): one step over lists of tensors of one
  // device, one param dtype (fp32, fp16, bf16) and one state dtype (the
  // param's or fp32), updated in place. grads: the params' dtype, never
  // written. max_exp_avg_sqs: one per param with amsgrad, else empty.
  // master_params: fp32 copies of 16-bit params (updated; the params receive
  // them rounded), or empty. steps: one fp32 count per param, incremented.
  // lr_tensor (fp32, on the device) overrides lr. grad_scale / found_inf (fp32,
  // on the device; GradScaler's): grads are divided by grad_scale, and nothing
  // changes (steps included) when found_inf != 0.
  m.def("adam_step(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
        "Tensor(c!)[] exp_avg_sqs, Tensor(d!)[] max_exp_avg_sqs, Tensor(e!)[] master_params, "
        "Tensor(f!)[] steps, float lr, float beta1, float beta2, float eps, float weight_decay, "
        "bool decoupled_weight_decay, bool amsgrad, bool maximize, Tensor? lr_tensor=None, "
        "Tensor? grad_scale=None, Tensor? found_inf=None) -> ()");
}

