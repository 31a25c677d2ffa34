// Passes over a checked Graph: dependencies, simplification, derivatives, interpretation and
// interval evaluation. Each is pure C++ over dsl/ir.h.
#pragma once

#include <functional>
#include <optional>
#include <span>
#include <vector>

#include "dsl/ir.h"

namespace flexc::dsl {

// ---- dependencies

struct Deps {
  std::array<bool, kNumInputs> inputs{};  // indexed by Input
  std::vector<uint16_t> params;           // runtime param slots read, ascending
  std::vector<uint16_t> captures;         // capture slots read, ascending
  bool reads(Input i) const { return inputs[static_cast<int>(i)]; }
};
Deps dependencies(const Graph& g, NodeId root);

// The score_mod returns `score` unchanged (after simplification).
bool is_identity_score(const Graph& g, NodeId root);
// The mask_mod is the constant `true`.
bool is_all_true_mask(const Graph& g, NodeId root);

// ---- simplification: constant folding and exact identities only (a float result never changes,
// NaN and signed zeros included). Returns a new graph holding only what the root reaches.
Graph simplify(const Graph& g);

// ---- interpretation (the CPU oracle). Semantics as documented in dsl/ir.h.

// A captured tensor on the host, element type per its declaration, shape resolved.
struct HostTensor {
  DType dtype = DType::F32;
  const void* data = nullptr;          // bf16/fp16 as raw uint16 bits
  std::vector<int64_t> shape;          // rank = declaration's rank
  std::vector<int64_t> strides;        // in elements; empty = contiguous
};

struct EvalEnv {
  std::array<int64_t, kNumInputs> ints{};  // b, h, q_idx, kv_idx, q_len, kv_len (Score unused)
  double score = 0;
  std::span<const double> params;          // runtime param values by slot (Int ones hold ints)
  std::span<const HostTensor> captures;    // by slot
};

// A value of any type: Bool/Int in `i`, Float in `f`.
struct Value {
  Type type = Type::Float;
  int64_t i = 0;
  double f = 0;
};

// Float arithmetic in float64 (the oracle) or rounded to float32 after every op (what a kernel
// computes up to the accuracy of its math functions).
enum class Precision { F64, F32 };

// Evaluates every node reachable from the root; `scratch` avoids reallocations in hot loops.
Value evaluate(const Graph& g, const EvalEnv& env, Precision p = Precision::F64);
Value evaluate(const Graph& g, const EvalEnv& env, Precision p, std::vector<Value>& scratch);

// ---- derivatives of a score_mod, for the backward kernel

// d(root)/d(score), as a new expression in the same graph (reads the same inputs; may read score).
NodeId derivative_wrt_score(Graph& g, NodeId root);

// For each Load node of a Float capture that the root depends on: d(root)/d(that loaded value).
// The backward kernel adds dScore * derivative into the capture's gradient at the same index.
struct LoadDerivative {
  NodeId load;        // the Load node (its indices say where the gradient goes)
  NodeId derivative;  // expression in the same graph
};
std::vector<LoadDerivative> derivatives_wrt_loads(Graph& g, NodeId root);

// ---- interval evaluation

enum class Verdict { AlwaysFalse, AlwaysTrue, Unknown };

// Closed integer range [lo, hi] of one index over a tile.
struct IntRange {
  int64_t lo = 0, hi = 0;
};

struct IntervalEnv {
  IntRange b, h, q_idx, kv_idx;  // the tile
  int64_t q_len = 0, kv_len = 0;
  std::span<const double> params;  // runtime param values (known at BlockMask build time)
  // Optional: the range of values of capture `slot` over index box `idx` (one IntRange per dim,
  // already inside [0, dim)). Return nullopt when unknown. Absent: captures are unknown.
  std::function<std::optional<std::pair<double, double>>(uint16_t slot,
                                                         std::span<const IntRange> idx)>
      capture_range;
  // Capture shapes by slot, to decide whether an index range needs wrapping.
  std::span<const std::vector<int64_t>> capture_shapes;
};

// Sound: AlwaysTrue only if the mask is true at every point of the tile (AlwaysFalse likewise).
Verdict interval_verdict(const Graph& g, NodeId root, const IntervalEnv& env);

}  // namespace flexc::dsl
