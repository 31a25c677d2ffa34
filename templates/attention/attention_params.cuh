// Runtime arguments of the attention kernels, shared verbatim by the kernel templates and the
// host (src/attention/attention.cpp includes this file), so the layout cannot drift. Plain C++
// only.
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
  float* lse;             // may be null
  long long q_stride[3];  // batch, head, seq
  long long k_stride[3];
  long long v_stride[3];
  long long o_stride[3];
  int batch, q_heads, kv_heads;  // q_heads % kv_heads == 0
  int q_len, kv_len;             // the tensors' rows
  // Where the rows sit in their sequence, as the mods see them: q_idx = q_pos0 + row, kv_idx =
  // kv_pos0 + row, and the sequence's lengths hook_q_len >= q_pos0 + q_len and hook_kv_len >=
  // kv_pos0 + kv_len (chunked prefill: q_pos0 > 0; a block of a longer sequence, as ring
  // attention computes: both; otherwise 0, 0, q_len, kv_len).
  // (Kernels built without FLEXC_POSITIONS read q_pos0 alone: attention_tile.cuh, kPositions.)
  int q_pos0, kv_pos0;
  int hook_q_len, hook_kv_len;
  float scale;       // softmax scale: score_mod sees scale * q.k
  float scale_log2;  // scale * log2(e), for identity score_mods
  // Packed sequences (kernels built with FLEXC_VARLEN; flexc::attention's PackedSequences):
  // sequence b's queries are rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1 of q and o, its keys
  // rows cu_seqlens_kv[b] .. cu_seqlens_kv[b + 1] - 1 of k and v, the batch strides are 0, q_len
  // and kv_len are the longest sequence's, and lse is [q_heads, total_q]. The kernel makes each
  // CTA's own view (flexc_attn::sequence_params), whose q_start / kv_start are the sequence's first
  // rows (0 in every other call).
  const int* cu_seqlens_q;
  const int* cu_seqlens_kv;
  int total_q, total_kv;  // q's and k's rows
  int q_start, kv_start;
};

// What the backward kernels (templates/attention_bwd*.cuh) take beyond the forward's tensors:
// FlexcAttentionParams::o is the forward's output and lse its log-sum-exp (both set). dq, dk, dv
// have q's, k's, v's shapes, in the input type (float32 in a FLEXC_F32_OUT build); delta and
// dq_accum are flexc's workspace.
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

// The decode kernel's arguments (templates/attention/attention_decode.cuh): Q_LEN queries per
// sequence against a KV cache of per-sequence lengths. q and o are [batch, q_heads, q_len, D / Dv]
// as above. The cache is contiguous ([batch, kv_heads, capacity, D]: page_table null, strides are
// batch, head, seq) or paged (k / v [num_pages, kv_heads, page_size, D] with any page / head /
// slot strides, so NHD and HND layouts alike; key i of sequence b is slot i % page_size of page
// page_table[b * page_table_stride + i / page_size]). Lengths, positions and the page table
// are device data, read by the kernel: a step changes them without any host work.
struct FlexcDecodeParams {
  const void* q;
  const void* k;
  const void* v;
  void* o;
  float* lse;             // may be null; [batch, q_heads, q_len] contiguous
  float* o_part;          // splits > 1: [batch, q_heads, q_len, splits, Dv] float32 workspace
  float* lse_part;        // splits > 1: [batch, q_heads, q_len, splits]
  const int* kv_lens;     // [batch]: keys [0, kv_lens[b]) are attended
  const int* q_offsets;   // [batch] or null: query i sits at position q_offsets[b] + i
                          // (null: kv_lens[b] - q_len + i)
  const int* page_table;  // null: contiguous
  long long q_stride[3];
  long long o_stride[3];
  long long k_stride[3];  // contiguous: batch, head, seq; paged: page, head, slot
  long long v_stride[3];
  long long page_table_stride;
  int batch, q_heads, kv_heads, q_len;
  int capacity;    // keys a sequence can hold (contiguous: the cache's length; paged: the page
                   // table's width x page_size); the length captures' Q_LEN / KV_LEN dims take
  int num_pages;   // paged: page indices must lie in [0, num_pages)
  int page_shift;  // paged: log2(page_size)
  int splits;      // kv splits per sequence (gridDim.x)
  float scale, scale_log2;
};

// The combine of partial attention results (templates/tile/attention_combine.cuh): for each of
// `rows` rows, `parts` (out, LSE) pairs, out normalised, in float32, merged as one softmax.
struct FlexcCombineParams {
  const float* o_part;    // [rows, parts, dv]
  const float* lse_part;  // [rows, parts], natural log; -inf: the part saw no key
  void* out;              // row r = (b * heads + h) * q_len + i at b, h, i of out_stride
  float* lse;             // may be null; [rows]
  long long out_stride[3];
  int heads, q_len, rows, parts, dv;
};

// Ring attention's accumulators (templates/tile/attention_combine.cuh): flexc_attention_merge_store
// writes float32 accumulators of `acc_rows` rows a head out in the output's type, and their LSE
// as rows row0.. of an LSE of `lse_rows` rows a head. The backward's gradients:
// flexc_grad_accumulate adds a part (`rows` rows a head) into rows row0.. of float32
// accumulators, and merge_store without an LSE writes them out; `dv` is then the gradient's
// head dim.
struct FlexcMergeParams {
  const void* part;          // flexc_grad_accumulate: float32 [batch, heads, rows, dv], part_stride
  float* acc;                // [batch, heads, acc_rows, dv], contiguous
  float* acc_lse;            // merge_store: [batch, heads, acc_rows] (read only with lse)
  void* out;                 // merge_store: 16-bit [batch, heads, acc_rows, dv], out_stride
  float* lse;                // merge_store: may be null; [batch, heads, lse_rows], its rows row0..
  long long part_stride[3];  // (batch, head, row)
  long long out_stride[3];
  int batch, heads, rows, acc_rows, row0, dv;
  int lse_rows;
};
