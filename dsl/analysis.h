// Passes over a checked Graph: dependencies, simplification, derivatives, interpretation and
// interval evaluation. Each is pure C++ over dsl/ir.h.
#pragma once

#include <functional>
#include <memory>
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

// reached[id] for id <= root: whether `root` depends on node `id` (itself included).
std::vector<char> reachable(const Graph& g, NodeId root);

// The score_mod returns `score` unchanged (after simplification).
bool is_identity_score(const Graph& g, NodeId root);
// The mask_mod is the constant `true`.
bool is_all_true_mask(const Graph& g, NodeId root);

// ---- simplification: constant folding and exact identities only (a float result never changes,
// NaN and signed zeros included). Returns a new graph holding only what the root reaches.
// A float operation on constants is folded only when its float32 and float64 results agree (so
// neither the kernel's nor the oracle's value moves: `2.0 * 3.0` folds, `0.1 * 3.0` stays), and
// transcendental functions and sqrt are never folded (CUDA's may differ from the host's).
Graph simplify(const Graph& g);
// The same rewrite of the expression at `root`, added to `g` itself; returns its new root. Nodes
// it no longer needs stay in `g` (unreachable from the result).
NodeId simplify_into(Graph& g, NodeId root);

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
// computes up to the accuracy of its math functions). F32Approx: F32 with tanh's result rounded
// to 11 significant bits, the error of the approx build's tanh.approx (dsl/emit_cuda.h).
enum class Precision { F64, F32, F32Approx };

// Evaluates every node reachable from the root; `scratch` avoids reallocations in hot loops.
// (It walks all nodes with ids up to the root: on a simplified graph those are exactly the
// reachable ones.) Choices ir.h leaves open, which the CUDA emitter implements identically:
//  - min/max of floats follow CUDA's fminf/fmaxf: a NaN operand is ignored (NaN only if both
//    are), and -0.0 counts as less than +0.0; clamp(x, lo, hi) = min(max(x, lo), hi).
//  - sign(x) is 1 or -1 for x > 0 or x < 0 and x itself otherwise (±0 and NaN stay); on ints
//    -1/0/1. abs(INT_MIN) == INT_MIN (wrap).
//  - sigmoid(x) = 1 / (1 + exp(-x)), rsqrt(x) = 1 / sqrt(x).
//  - F32: constants, params, score and promoted ints are rounded to float32 where they enter;
//    float `%` rounds its three steps separately (no fused multiply-add).
//  - An Int param's value is converted like int(); a Bool capture element is true when nonzero.
// Throws std::invalid_argument when env lacks a param or capture the graph reads, or a capture's
// dtype, rank or shape does not fit its Load.
Value evaluate(const Graph& g, const EvalEnv& env, Precision p = Precision::F64);
Value evaluate(const Graph& g, const EvalEnv& env, Precision p, std::vector<Value>& scratch);
// The same for the expression at `root` (e.g. a derivative added to the mod's graph).
Value evaluate(const Graph& g, NodeId root, const EvalEnv& env, Precision p,
               std::vector<Value>& scratch);
// One operation (not a leaf: Const, Input, Param, Load) applied to its operands' values, which for
// F32 must already be float32 values.
Value evaluate_op(const Node& n, std::span<const Value> args, Precision p);

// The element a Load reads: its index operands' values (in `vals`, indexed by node id, as
// evaluate's scratch leaves them) wrapped into [0, dim) as the kernels wrap them, then through
// `strides` (elements; empty: contiguous). Every dim must be positive.
int64_t load_offset(const Node& load, const Value* vals, std::span<const int64_t> shape,
                    std::span<const int64_t> strides);

// ---- derivatives of a score_mod, for the backward kernel

// d(root)/d(score), as a new expression in the same graph (reads the same inputs; may read score).
NodeId derivative_wrt_score(Graph& g, NodeId root);

// For each Load node of a Float capture that the root depends on: d(root)/d(that loaded value).
// The backward kernel adds dScore * derivative into the capture's gradient at the same index.
// Loads whose derivative is identically zero (e.g. read only through floor or a comparison) are
// left out. Listed in node order.
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
  // already inside [0, dim)). Return nullopt when unknown (and for a Float capture, when an
  // element in the box is NaN). A Bool capture's range is over 0/1. Absent: captures are unknown.
  std::function<std::optional<std::pair<double, double>>(uint16_t slot,
                                                         std::span<const IntRange> idx)>
      capture_range;
  // Capture shapes by slot, to decide whether an index range needs wrapping.
  std::span<const std::vector<int64_t>> capture_shapes;
};

// Sound: AlwaysTrue only if the mask is true at every point of the tile (AlwaysFalse likewise),
// for the float64 oracle and for a float32 kernel alike (float results are widened by a margin
// that covers float32 rounding and CUDA's math functions). Exact on comparisons of linear
// expressions of the indices and on the catalogue's masks away from their boundaries.
Verdict interval_verdict(const Graph& g, NodeId root, const IntervalEnv& env);

// The same for many tiles of one mask: keeps its scratch between calls (interval_verdict builds
// one per call). `g` must outlive it; one evaluator per thread.
class IntervalEvaluator {
 public:
  IntervalEvaluator(const Graph& g, NodeId root);
  ~IntervalEvaluator();
  IntervalEvaluator(IntervalEvaluator&&) noexcept;
  IntervalEvaluator& operator=(IntervalEvaluator&&) noexcept;
  Verdict verdict(const IntervalEnv& env);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace flexc::dsl
