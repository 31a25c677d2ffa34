#include "dsl/parser.h"

#include <cmath>
#include <fmt/format.h>
#include <limits>

namespace flexc::dsl {

namespace {

// Thrown after a syntax error has been reported; caught at the statement level.
struct SyntaxError {};

struct BinaryOp {
  Op op;
  int prec;  // higher binds tighter; all binary operators are left-associative
};

bool binary_op(Tok t, BinaryOp& out) {
  switch (t) {
    case Tok::PipePipe: case Tok::Or: out = {Op::Or, 1}; return true;
    case Tok::AmpAmp: case Tok::And: out = {Op::And, 2}; return true;
    case Tok::Pipe: out = {Op::BitOr, 3}; return true;
    case Tok::Caret: out = {Op::BitXor, 4}; return true;
    case Tok::Amp: out = {Op::BitAnd, 5}; return true;
    case Tok::EqEq: out = {Op::Eq, 6}; return true;
    case Tok::NotEq: out = {Op::Ne, 6}; return true;
    case Tok::Lt: out = {Op::Lt, 7}; return true;
    case Tok::Le: out = {Op::Le, 7}; return true;
    case Tok::Gt: out = {Op::Gt, 7}; return true;
    case Tok::Ge: out = {Op::Ge, 7}; return true;
    case Tok::Shl: out = {Op::Shl, 8}; return true;
    case Tok::Shr: out = {Op::Shr, 8}; return true;
    case Tok::Plus: out = {Op::Add, 9}; return true;
    case Tok::Minus: out = {Op::Sub, 9}; return true;
    case Tok::Star: out = {Op::Mul, 10}; return true;
    case Tok::Slash: out = {Op::Div, 10}; return true;
    case Tok::SlashSlash: out = {Op::FloorDiv, 10}; return true;
    case Tok::Percent: out = {Op::Mod, 10}; return true;
    default: return false;
  }
}

bool is_keyword_token(Tok t) {
  switch (t) {
    case Tok::Let: case Tok::True: case Tok::False: case Tok::Inf: case Tok::Nan:
    case Tok::And: case Tok::Or: case Tok::Not:
      return true;
    default:
      return false;
  }
}

class Parser {
 public:
  Parser(std::string_view src, const std::vector<Token>& toks, int max_depth, size_t max_errors,
         std::vector<Diagnostic>& diags)
      : src_(src), toks_(toks), max_depth_(max_depth), max_errors_(max_errors), diags_(diags) {}

  SyntaxTree run() {
    const size_t errors_before = diags_.size();
    bool have_result = false;
    while (diags_.size() < max_errors_) {
      if (tok().kind == Tok::End) {
        if (!have_result && diags_.size() == errors_before)
          error(tok().range, tree_.lets.empty() ? "expected an expression"
                                                : "expected the final expression after the let bindings");
        break;
      }
      try {
        if (tok().kind == Tok::Let) {
          let_binding();
          continue;
        }
        tree_.result = expression();
        have_result = true;
        if (tok().kind == Tok::Semicolon) ++pos_;
        if (tok().kind != Tok::End) unexpected_after_expression();
        break;
      } catch (const SyntaxError&) {
        // Resume after the next `;`: the following statements are checked for syntax too.
        depth_ = 0;
        while (tok().kind != Tok::End && tok().kind != Tok::Semicolon) ++pos_;
        if (tok().kind == Tok::Semicolon) ++pos_;
      }
    }
    return std::move(tree_);
  }

 private:
  // Counts nesting on the way down; past the limit, a clean error instead of a deep stack.
  class Nest {
   public:
    Nest(Parser& p, SrcRange at) : p_(p) {
      if (++p_.depth_ > p_.max_depth_)
        p_.fail(at, fmt::format("expression is nested too deeply (more than {} levels)",
                                p_.max_depth_));
    }
    ~Nest() { --p_.depth_; }
    Nest(const Nest&) = delete;
    Nest& operator=(const Nest&) = delete;

   private:
    Parser& p_;
  };

  const Token& tok() const { return toks_[pos_]; }
  // An empty range just after the previous token: where a missing `;` belongs.
  SrcRange after_previous() const {
    const uint32_t at = pos_ > 0 ? toks_[pos_ - 1].range.end : 0;
    return {at, at};
  }

  void error(SrcRange r, std::string message, std::string hint = {}) {
    diags_.push_back({Severity::Error, r, std::move(message), std::move(hint)});
  }
  [[noreturn]] void fail(SrcRange r, std::string message, std::string hint = {}) {
    error(r, std::move(message), std::move(hint));
    throw SyntaxError{};
  }
  // Expected `closing` to end what `opening` began; reports with a note at the opening token.
  void expect_closing(Tok closing, std::string_view what, const Token& opening) {
    if (tok().kind == closing) {
      ++pos_;
      return;
    }
    error(tok().range, fmt::format("expected {}", what));
    diags_.push_back({Severity::Note, opening.range,
                      fmt::format("to match this {}", describe(opening, src_)), {}});
    throw SyntaxError{};
  }

  uint32_t add(SyntaxNode n, std::span<const uint32_t> kids = {}) {
    n.first_child = static_cast<uint32_t>(tree_.children.size());
    n.num_children = static_cast<uint32_t>(kids.size());
    tree_.children.insert(tree_.children.end(), kids.begin(), kids.end());
    tree_.nodes.push_back(n);
    return static_cast<uint32_t>(tree_.nodes.size() - 1);
  }
  SrcRange span(uint32_t first, uint32_t last) const {
    return {tree_.nodes[first].range.begin, tree_.nodes[last].range.end};
  }

  void let_binding() {
    ++pos_;
    if (tok().kind != Tok::Ident)
      fail(tok().range, "expected a name after 'let'",
           is_keyword_token(tok().kind) ? fmt::format("{} is a reserved word", describe(tok(), src_))
                                  : std::string());
    LetBinding b;
    b.name_range = tok().range;
    b.name = src_.substr(b.name_range.begin, b.name_range.end - b.name_range.begin);
    ++pos_;
    if (tok().kind != Tok::Assign)
      fail(tok().range, fmt::format("expected '=' after 'let {}'", clip(b.name)));
    ++pos_;
    b.value = expression();
    if (tok().kind != Tok::Semicolon) fail(after_previous(), "expected ';' after the let binding");
    ++pos_;
    tree_.lets.push_back(b);
  }

  [[noreturn]] void unexpected_after_expression() {
    const Token& t = tok();
    std::string hint;
    if (t.kind == Tok::Assign) {
      const SyntaxNode& r = tree_.nodes[tree_.result];
      hint = r.kind == Syntax::Name
                 ? fmt::format("write 'let {} = ...;' to bind a name, or '==' to compare", clip(r.name))
                 : "write '==' to compare";
    } else if (t.kind == Tok::Let) {
      hint = "let bindings come before the final expression";
    } else if (t.kind == Tok::StarStar) {
      hint = "write pow(a, b)";
    }
    fail(t.range, fmt::format("unexpected {} after the expression", describe(t, src_)),
         std::move(hint));
  }

  // expression := binary ('?' expression ':' expression)?   (right-associative)
  uint32_t expression() {
    const uint32_t cond = binary(1);
    if (tok().kind != Tok::Question) return cond;
    const Token question = tok();
    Nest nest(*this, question.range);
    ++pos_;
    const uint32_t a = expression();
    expect_closing(Tok::Colon, "':' in the conditional expression", question);
    const uint32_t b = expression();
    SyntaxNode n;
    n.kind = Syntax::Select;
    n.op = Op::Select;
    n.range = span(cond, b);
    n.op_range = question.range;
    const uint32_t kids[3] = {cond, a, b};
    return add(n, kids);
  }

  // Precedence climbing over the left-associative binary operators.
  uint32_t binary(int min_prec) {
    uint32_t lhs = unary();
    BinaryOp bop{};
    while (binary_op(tok().kind, bop) && bop.prec >= min_prec) {
      const SrcRange op_range = tok().range;
      Nest nest(*this, op_range);
      ++pos_;
      const uint32_t rhs = binary(bop.prec + 1);
      SyntaxNode n;
      n.kind = Syntax::Binary;
      n.op = bop.op;
      n.range = span(lhs, rhs);
      n.op_range = op_range;
      const uint32_t kids[2] = {lhs, rhs};
      lhs = add(n, kids);
    }
    return lhs;
  }

  uint32_t unary() {
    const Token t = tok();
    Op op;
    switch (t.kind) {
      case Tok::Minus: op = Op::Neg; break;
      case Tok::Bang: case Tok::Not: op = Op::Not; break;
      case Tok::Tilde: op = Op::BitNot; break;
      default: return primary();
    }
    Nest nest(*this, t.range);
    ++pos_;
    // `-5` is one literal, so that -2147483648 (whose digits alone are out of range) can be
    // written. NaN has no sign.
    if (op == Op::Neg && is_number(tok().kind)) {
      const uint32_t lit = literal();
      SyntaxNode& n = tree_.nodes[lit];
      n.ival = -n.ival;
      if (!std::isnan(n.fval)) n.fval = -n.fval;
      n.range.begin = t.range.begin;
      return lit;
    }
    const uint32_t operand = unary();
    SyntaxNode n;
    n.kind = Syntax::Unary;
    n.op = op;
    n.range = {t.range.begin, tree_.nodes[operand].range.end};
    n.op_range = t.range;
    const uint32_t kids[1] = {operand};
    return add(n, kids);
  }

  static bool is_number(Tok t) {
    return t == Tok::Int || t == Tok::Float || t == Tok::Inf || t == Tok::Nan;
  }

  uint32_t literal() {
    const Token& t = tok();
    SyntaxNode n;
    n.range = n.op_range = t.range;
    switch (t.kind) {
      case Tok::Int: n.kind = Syntax::Int; n.ival = static_cast<int64_t>(t.ival); break;
      case Tok::Float: n.kind = Syntax::Float; n.fval = t.fval; break;
      case Tok::Inf: n.kind = Syntax::Float; n.fval = std::numeric_limits<double>::infinity(); break;
      case Tok::Nan: n.kind = Syntax::Float; n.fval = std::numeric_limits<double>::quiet_NaN(); break;
      case Tok::True: n.kind = Syntax::Bool; n.ival = 1; break;
      default: n.kind = Syntax::Bool; n.ival = 0; break;  // Tok::False
    }
    ++pos_;
    return add(n);
  }

  uint32_t primary() {
    const Token t = tok();
    switch (t.kind) {
      case Tok::Int: case Tok::Float: case Tok::Inf: case Tok::Nan: case Tok::True: case Tok::False:
        return literal();
      case Tok::Ident: return name();
      case Tok::LParen: {
        Nest nest(*this, t.range);
        ++pos_;
        const uint32_t inner = expression();
        const uint32_t end = tok().range.end;
        expect_closing(Tok::RParen, "')'", t);
        tree_.nodes[inner].range = {t.range.begin, end};
        tree_.nodes[inner].parenthesized = true;
        return inner;
      }
      default: break;
    }
    std::string hint;
    if (t.kind == Tok::StarStar) hint = "write pow(a, b)";
    else if (t.kind == Tok::Assign) hint = "write '==' to compare";
    fail(t.range, "expected an expression", std::move(hint));
  }

  // A name, a call `name(args)` or an index `name[idx]`.
  uint32_t name() {
    const Token t = tok();
    ++pos_;
    SyntaxNode n;
    n.kind = Syntax::Name;
    n.range = n.op_range = t.range;
    n.name = src_.substr(t.range.begin, t.range.end - t.range.begin);
    const Tok open = tok().kind;
    if (open != Tok::LParen && open != Tok::LBracket) return add(n);
    const Token opening = tok();
    const bool call = open == Tok::LParen;
    const Tok close = call ? Tok::RParen : Tok::RBracket;
    Nest nest(*this, opening.range);
    ++pos_;
    std::vector<uint32_t> args;
    if (!call || tok().kind != close) {
      while (true) {
        args.push_back(expression());
        if (tok().kind != Tok::Comma) break;
        ++pos_;
      }
    }
    const uint32_t end = tok().range.end;
    expect_closing(close, call ? "',' or ')'" : "',' or ']'", opening);
    n.kind = call ? Syntax::Call : Syntax::Index;
    n.range = {t.range.begin, end};
    return add(n, args);
  }

  std::string_view src_;
  const std::vector<Token>& toks_;
  int max_depth_;
  size_t max_errors_;
  std::vector<Diagnostic>& diags_;
  size_t pos_ = 0;
  int depth_ = 0;
  SyntaxTree tree_;
};

}  // namespace

SyntaxTree parse(std::string_view source, const std::vector<Token>& tokens, int max_depth,
                 size_t max_errors, std::vector<Diagnostic>& diags) {
  return Parser(source, tokens, max_depth, max_errors, diags).run();
}

}  // namespace flexc::dsl
