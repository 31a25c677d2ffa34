// Checked IR -> CUDA C++. The only place in flexc that writes CUDA from a mod; user identifiers
// never appear in the output (params and captures are referred to by slot).
#pragma once

#include <string>

#include "dsl/ir.h"

namespace flexc::dsl {

// How score_mod's float operations are written (docs/dsl.md, "Precision"). Exact: each one
// rounded as IEEE float32 (the interpreter's F32 mode, bit for bit). Fast: the GPU's approximate
// instructions (ex2 / lg2 / sin / cos / rsqrt / sqrt / rcp .approx, fast division; a few ulp
// each) and + - * left for the compiler to contract into FMAs, except where a float decides a
// discrete outcome. Approx: Fast with tanh on tanh.approx (2^-11 relative: FlashAttention-3's
// softcap), beyond the tolerance rule Fast keeps. mask_mod is always exact: the BlockMask's
// analysis decides tiles from its exact semantics.
enum class FloatMath { Exact, Fast, Approx };

// Everything the kernels' hooks need from one variant.
struct EmitInput {
  const Graph* score = nullptr;  // root: Float; reads Input::Score
  const Graph* mask = nullptr;   // root: Bool
  const Decls* decls = nullptr;
  std::string variant_name;      // only written into a comment, sanitised
  FloatMath score_math = FloatMath::Exact;  // score_mod, its derivatives and capture gradients
};

// Emits the text of `flexc_variant.cuh`, a header defining `struct FlexcVariant` with the hooks
// documented in templates/flexc_hooks.cuh:
//   score_mod, mask_mod, score_mod_grad (d score_mod / d score), capture gradient accumulation,
//   and constexpr facts (kIdentityScore, kMaskAlwaysTrue, kMaskReadsB, ...).
// The text is a pure function of the inputs (stable cache keys). Each statement that comes from
// user code carries a `// @score_mod:<begin>:<end>` or `// @mask_mod:<begin>:<end>` marker comment
// on its line so that compiler errors can be mapped back to the user's expression.
std::string emit_cuda_variant(const EmitInput& in);

// What a kernel's launch must agree on with the header emit_cuda_variant writes (the same
// analysis, so the two never disagree).
struct LaunchFacts {
  // FlexcVariant::kScoreTilesShareHeads: score_mod reads a 16-bit [.., Q_LEN, KV_LEN] capture
  // through tile loads that do not depend on the head. The Hopper forward kernel then takes its
  // head from blockIdx.x and its q tile from blockIdx.y, so that the CTAs of one q tile's heads
  // launch together and share the capture's rows in L2.
  bool score_tiles_share_heads = false;
  // FlexcVariant::kScoreRelTerms: score_mod's terms in kv_idx - q_idx that the forward kernels
  // tabulate per tile in shared memory (their launch adds the bytes).
  int score_rel_terms = 0;
  // FlexcVariant::kScoreColumnLoads + kMaskColumnLoads: the loads the Hopper forward kernel
  // stages in shared memory per kv tile (its launch adds the bytes).
  int column_loads = 0;
  // score_mod's tile load (at most one): the capture slot, its kv dim and its q dim (indexed by
  // kv_idx and q_idx themselves); -1 when there is none / the q index is not q_idx itself. The
  // Hopper forward kernel then loads the tile by TMA where the capture's layout allows.
  int score_tile_slot = -1, score_tile_kv_dim = -1, score_tile_q_dim = -1;
  // score_mod as the forward kernels compute it (its row terms apart: FlexcVariant::
  // kRowlessIdentity, or kIdentityScore) is the identity: the Hopper forward kernel's wide kv
  // tiles at D 128 only then (a score_mod's own math wants the registers S takes).
  bool forward_identity = false;
};
LaunchFacts launch_facts(const EmitInput& in);

// The most any variant's hooks stage per launch: kMaxColumnLoads column loads of score_mod and as
// many of mask_mod's, kMaxRelTerms relative terms. A kernel configuration that must fit shared
// memory for every variant reserves kMostLaunchFacts' bytes.
inline constexpr int kMaxColumnLoads = 2;
inline constexpr int kMaxRelTerms = 2;
inline constexpr LaunchFacts kMostLaunchFacts{false, kMaxRelTerms, 2 * kMaxColumnLoads};

}  // namespace flexc::dsl
