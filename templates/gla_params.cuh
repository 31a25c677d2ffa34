// Runtime arguments of the gated linear attention kernels (templates/gla.cuh), shared verbatim
// by the template and the host (src/linear/gla.cpp includes this file). Plain C++ only.
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
  const void* g;           // null: no gate
  const float* h0;         // initial state, or null (zeros)
  float* ht;               // final state, or null
  // Workspace, written by one kernel and read by the next (templates/gla.cuh):
  void* states;            // [batch, heads, chunks, DK, DV] in q's type: each chunk's start state
  void* khat;              // [batch, heads, chunks * 64, DK] in q's type: k * exp(G - gc)
  float* decay;            // [batch, heads, chunks, DK]: exp(G), G the chunk's gate sum
  float* gcum;             // [batch, heads, chunks * 64, DK]: gc, the gates' sums in the chunk,
                           // log2 units
  long long q_stride[3];   // batch, head, seq
  long long k_stride[3];
  long long v_stride[3];
  long long o_stride[3];
  long long g_stride[4];   // batch, head, seq, key dim
  int batch, heads, k_heads;
  int seq_len, chunks;     // chunks = ceil(seq_len / 64)
  float scale;
};

// flexc_gla_states keeps this many chunks in flight, for a state slice of 64 key dims x this many
// value dims (its shared memory: per stage a 64 x 64 and a 64 x kFlexcGlaStateCols 16-bit tile
// and 64 floats).
constexpr int kFlexcGlaStatesStages = 4, kFlexcGlaStateCols = 32;
