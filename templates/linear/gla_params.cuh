// Runtime arguments of the gated linear attention kernels (templates/linear/gla.cuh), shared
// verbatim by the template and the host (src/linear/gla.cpp includes this file). Plain C++ only.
//
// q, k [batch, heads, seq, DK], v and o [batch, heads, seq, DV]: any batch / head / seq strides
// (elements), contiguous head dim, 16-byte aligned rows; k and v may have fewer heads (k_heads
// divides heads). g: log gates, any strides (0 broadcasts), g_stride[3] the key-dim stride (0 for
// one gate per step). States are float32 [batch, heads, DK, DV], contiguous.
#pragma once

struct FlexcGlaParams {
  const void* q;
  const void* k;
  const void* v;
  void* o;
  const void* g;    // null: no gate
  const float* h0;  // initial state, or null (zeros)
  float* ht;        // final state, or null
  // Workspace, written by one kernel and read by the next (templates/linear/gla.cuh):
  void* states;           // [batch, heads, chunks, DK, DV] in q's type: each chunk's start state
  void* khat;             // [batch, heads, chunks * 64, DK] in q's type: k * exp(G - gc)
  float* decay;           // [batch, heads, chunks, DK]: exp(G), G the chunk's gate sum
  float* gcum;            // [batch, heads, chunks * 64, DK]: gc, the gates' sums in the chunk,
                          // log2 units
  void* qexp;             // backward only (else null): [batch, heads, chunks * 64, DK] in q's
                          // type, scale * q * exp(gc), for the state gradients' pass
  long long q_stride[3];  // batch, head, seq
  long long k_stride[3];
  long long v_stride[3];
  long long o_stride[3];
  long long g_stride[4];  // batch, head, seq, key dim
  int batch, heads, k_heads;
  int seq_len, chunks;  // chunks = ceil(seq_len / 64)
  float scale;
};

// flexc_gla_states keeps this many chunks in flight, for a state slice of 64 key dims x this many
// value dims (its shared memory: per stage a 64 x 64 and a 64 x kFlexcGlaStateCols 16-bit tile
// and 64 floats).
constexpr int kFlexcGlaStatesStages = 4, kFlexcGlaStateCols = 32;

// The backward's own arguments (flexc_gla_backward, flexc_gla_dg_scan, flexc_gla_dg,
// flexc_gla_reduce): the forward's (workspace filled by flexc_gla_prepare and flexc_gla_states)
// and the gradients. dq has q's strides' layout rules; dk, dv are written in the input type with
// their strides when k_heads == heads, else as float32 per q head into dk32 / dv32
// ([batch, heads, seq, D], contiguous) for flexc_gla_reduce to sum.
struct FlexcGlaBwdParams {
  FlexcGlaParams f;
  const void* dout;
  void* dq;
  void* dk;
  void* dv;
  void* dg;          // null without gates; g's type (dg_type: 1 float32, 2 bf16, 3 fp16)
  const float* dht;  // the final state's gradient, or null
  void* dstates;     // [batch, heads, chunks, DK, DV] in q's type: dL / d(chunk end state)
  float* db;         // [batch, heads, chunks * 64, DK]: dL / d(gate cumulative sum)
  float* db_sums;    // [batch, heads, chunks, DK]: db summed over each chunk's rows, then
                     // (flexc_gla_dg_scan) over the later chunks
  float* dk32;
  float* dv32;
  long long dout_stride[3];
  long long dq_stride[3];
  long long dk_stride[3];
  long long dv_stride[3];
  long long dg_stride[4];
  int dg_type;
  int dg_sum_dims;  // 1: g is [batch, heads, seq], dg_t sums the key dims' gradients
};

// A feature map's kernels (templates/linear/gla_feature_map.cuh): x and y [n0, n1, n2, d] in the
// input type, strides in elements, contiguous rows of d (a multiple of 8) 16-byte aligned.
// flexc_feature_map writes y = phi(x); flexc_feature_map_grad scales y (a gradient) by phi'(x) in
// place.
struct FlexcMapParams {
  const void* x;
  void* y;
  long long x_stride[3];
  long long y_stride[3];
  long long n[3];
  int d;
};
