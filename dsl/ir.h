// The checked intermediate representation of a score_mod / mask_mod.
//
// A mod is a typed DAG held in a Graph: nodes live in one vector in topological order (every
// argument id is smaller than its user's id), identical nodes are shared (hash-consing), and
// `let` bindings are simply shared nodes. Every pass (simplify, derivative, interval analysis,
// interpreter, CUDA emitter) walks this one structure; none of them sees user text.
//
// Semantics (the interpreter and the CUDA emitter implement exactly these):
//  - Int is int32 with two's-complement wrap-around on + - * << and unary -.
//  - `/` is true division (result Float). `//` and `%` on Int are floored (Python); x // 0 == 0
//    and x % 0 == 0. On Float, `//` is floor(a / b) and `%` is a - b * floor(a / b).
//  - `<<` and `>>` use the shift count modulo 32; `>>` is arithmetic.
//  - Int and Float mix by promoting the Int to Float (float32 in kernels, float64 in the oracle).
//  - `int(x)` truncates toward zero, saturates to the int32 range, and maps NaN to 0.
//  - A captured tensor index outside [0, dim) wraps: the index is taken floored modulo dim.
//  - `&&`, `||`, `?:` and `where` are pure: both sides may be evaluated.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace flexc::dsl {

enum class Type : uint8_t { Bool, Int, Float };
std::string_view type_name(Type t);

// Built-in inputs a mod can read.
enum class Input : uint8_t { Score, B, H, QIdx, KvIdx, QLen, KvLen };
inline constexpr int kNumInputs = 7;
std::string_view input_name(Input i);  // "score", "b", "h", "q_idx", "kv_idx", "q_len", "kv_len"

enum class Op : uint8_t {
  // leaves
  Const,  // Bool/Int: `ival`; Float: `fval`
  Input,  // `input`
  Param,  // runtime scalar parameter number `slot` (a const param is folded to Const)
  // captured tensor element: tensor number `slot`, `nargs` Int indices
  Load,
  // unary
  Neg, Not, BitNot,
  // binary arithmetic / bitwise / logic
  Add, Sub, Mul, Div, FloorDiv, Mod, Shl, Shr,
  Lt, Le, Gt, Ge, Eq, Ne,
  BitAnd, BitXor, BitOr, And, Or,
  // (cond, a, b); `?:` and `where`
  Select,
  // built-in functions
  Min, Max, Abs, Clamp /*(x, lo, hi)*/, Exp, Exp2, Log, Log2, Sqrt, Rsqrt, Tanh, Sigmoid,
  Sin, Cos, Pow, Floor, Ceil, Sign, ToFloat, ToInt,
};
std::string_view op_name(Op op);  // spelling used by the printer: "+", "min", "where", ...

// Byte range [begin, end) in the mod's source text; {0, 0} when the node was synthesised.
struct SrcRange {
  uint32_t begin = 0, end = 0;
  bool empty() const { return begin == end; }
};

using NodeId = uint32_t;
inline constexpr int kMaxArgs = 4;  // Load of a rank-4 tensor

struct Node {
  Op op = Op::Const;
  Type type = Type::Float;
  uint8_t nargs = 0;
  Input input = Input::Score;  // Op::Input
  uint16_t slot = 0;           // Op::Param, Op::Load
  int64_t ival = 0;            // Op::Const of Bool / Int
  double fval = 0;             // Op::Const of Float (a float32-representable value in kernels)
  std::array<NodeId, kMaxArgs> args{};
  SrcRange src;                // for diagnostics only: not part of the node's identity

  std::span<const NodeId> operands() const { return {args.data(), nargs}; }
};

// Node identity for hash-consing (src excluded; a Float constant compares by bits).
bool same_node(const Node& a, const Node& b);

// How Graph::import renames what it copies.
struct ImportMap {
  std::array<int64_t, kNumInputs> input = {-1, -1, -1, -1, -1, -1, -1};  // -1: keep the input
  std::vector<uint16_t> param_slot;    // empty: identity
  std::vector<uint16_t> capture_slot;  // empty: identity
};

class Graph {
 public:
  // Adds a node (its args must already be in the graph) or returns the id of an identical one.
  NodeId add(const Node& n);

  // Builders. They set the result type from the operands' types (and promote Int to Float where
  // the semantics say so) but do no checking: the checker has already rejected ill-typed input.
  NodeId constant_bool(bool v);
  NodeId constant_int(int64_t v);
  NodeId constant_float(double v);
  NodeId input(Input i);
  NodeId param(uint16_t slot, Type t);
  NodeId load(uint16_t slot, Type elem, std::span<const NodeId> idx, SrcRange src = {});
  NodeId unary(Op op, NodeId a, SrcRange src = {});
  NodeId binary(Op op, NodeId a, NodeId b, SrcRange src = {});
  NodeId ternary(Op op, NodeId a, NodeId b, NodeId c, SrcRange src = {});  // Select, Clamp
  NodeId to_float(NodeId a);  // no-op for Float

  // Copies the part of `other` reachable from `from` into this graph. `map.input` substitutes
  // inputs with nodes of this graph (e.g. Input::Score -> the inner score_mod's root, for
  // composition); the slot maps renumber params / captures when declarations are merged.
  // Returns the copied node.
  NodeId import(const Graph& other, NodeId from, const ImportMap& map = ImportMap{});

  const Node& operator[](NodeId id) const { return nodes_[id]; }
  size_t size() const { return nodes_.size(); }
  std::span<const Node> nodes() const { return nodes_; }

  NodeId root = 0;

 private:
  std::vector<Node> nodes_;
  std::unordered_multimap<uint64_t, NodeId> index_;
};

// ---- declarations a variant makes: captured tensors and scalar parameters

enum class DType : uint8_t { I32, F32, BF16, F16, Bool };
std::string_view dtype_name(DType d);  // "int32", "float32", "bf16", "fp16", "bool"
Type dtype_value_type(DType d);        // I32 -> Int, Bool -> Bool, others -> Float

// A captured tensor's dimension: a fixed extent or a symbol resolved from the call's shapes.
struct Dim {
  enum Kind : uint8_t { Fixed, B, H, QLen, KvLen } kind = Fixed;
  int64_t extent = 0;  // Fixed only
};
std::string dim_name(const Dim& d);  // "B", "H", "Q_LEN", "KV_LEN" or the number

struct CaptureDecl {
  std::string name;
  DType dtype = DType::F32;
  std::vector<Dim> dims;  // rank 1..4
};

struct ParamDecl {
  std::string name;
  Type type = Type::Float;  // Int or Float
  double default_value = 0;
  bool is_const = false;  // const: folded into the code; runtime: a kernel argument
};

struct Decls {
  std::vector<CaptureDecl> captures;  // Load slot = index here
  std::vector<ParamDecl> params;      // Param slot = index here
};

// ---- a checked mod

// Map: a float function of one float, written in `x` (a linear-attention feature map); `x` is
// Input::Score in the graph, so that every pass (emitter, derivatives, interpreter) treats it
// as a score_mod reading nothing else.
enum class ModKind : uint8_t { Score, Mask, Map };

struct Mod {
  ModKind kind = ModKind::Score;
  Graph graph;          // graph.root is the result: Float for Score, Bool for Mask
  std::string source;   // the text it was parsed from (empty when built by composition)
  std::string origin;   // what to call it in messages: "score_mod", "alibi.json: mask_mod"
};

// Prints the expression rooted at `root` as normalized DSL text (fully determined by the graph:
// shared subexpressions are printed inline, minimal parentheses, declared names for slots).
// `score_name` spells Input::Score ("x" for a Map).
std::string to_text(const Graph& g, NodeId root, const Decls& decls,
                    std::string_view score_name = "score");

}  // namespace flexc::dsl
