// Runtime arguments of the attention kernels, shared verbatim by the kernel templates and the
// host (src/attention.cpp includes this file), so the layout cannot drift. Plain C++ only.
//
// Tensors are [batch, heads, seq, head_dim] with any batch / head / seq strides (in elements) and
// a contiguous head_dim; rows start 16-byte aligned. LSE is fp32 [batch, q_heads, q_len],
// contiguous, natural log.
#pragma once

struct FlexcAttentionParams {
  const void* q;
  const void* k;
  const void* v;
  void* o;
  float* lse;  // may be null
  long long q_stride[3];  // batch, head, seq
  long long k_stride[3];
  long long v_stride[3];
  long long o_stride[3];
  int batch, q_heads, kv_heads;  // q_heads % kv_heads == 0
  int q_len, kv_len;
  float scale;       // softmax scale: score_mod sees scale * q.k
  float scale_log2;  // scale * log2(e), for identity score_mods
};

// What the backward kernels (templates/attention_bwd.cuh) take beyond the forward's tensors:
// FlexcAttentionParams::o is the forward's output and lse its log-sum-exp (both set). dq, dk, dv
// have q's, k's, v's shapes, in the input type; delta and dq_accum are flexc's workspace.
struct FlexcAttentionBwdParams {
  FlexcAttentionParams fwd;
  const void* dout;
  void* dq;
  void* dk;
  void* dv;
  long long do_stride[3];
  long long dq_stride[3];
  long long dk_stride[3];
  long long dv_stride[3];
  const float* dlse;  // may be null; [batch, q_heads, q_len] contiguous
  float* delta;       // [batch, q_heads, q_len] workspace
  float* dq_accum;    // workspace in flexc_attn::DqAccum's layout (attention_tile.cuh)
};

// A TMA descriptor (the driver's CUtensorMap, built by cuTensorMapEncodeTiled), passed by value as
// a __grid_constant__ kernel parameter to the Hopper kernel.
struct alignas(64) FlexcTensorMap {
  unsigned long long opaque[16];
};
