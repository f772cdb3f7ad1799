// The renderer's expressions: names, literals, attribute and item access,
// slices, calls, filters and tests, and the operators (see jinja_runtime.h).
#include <algorithm>
#include <cmath>
#include <optional>

#include "text/jinja_runtime.h"
#include "text/jinja_string.h"

namespace mlarun::text::jinja {
namespace {

// The undefined value of a missing attribute or item: "'str object' has no
// attribute 'x'" (`attribute`: the name quoted, or the key's repr).
Value NoAttribute(const Value& obj, const std::string& attribute) {
  std::string what = "'";
  what += TypeName(obj);
  what += " object' has no attribute ";
  what += attribute;
  return Value::Undefined(std::move(what));
}

}  // namespace

// ----- values -----

StatusOr<ValueList> Renderer::Iterate(const Value& v) {
  switch (v.kind) {
    case Kind::kUndefined:
      return ValueList{};
    case Kind::kList:
      return *v.list;
    case Kind::kDict: {
      ValueList keys;
      keys.reserve(v.dict->items.size());
      for (const auto& kv : v.dict->items) keys.push_back(Value::Str(kv.first));
      return keys;
    }
    case Kind::kString: {
      ValueList chars;
      for (char32_t c : DecodeUtf8(v.s)) {
        std::string one;
        AppendUtf8(&one, c);
        chars.push_back(Value::Str(std::move(one)));
      }
      return chars;
    }
    default:
      return InvalidArgumentError("'", TypeName(v), "' object is not iterable");
  }
}

StatusOr<Value> Renderer::GetAttr(const Value& obj, const std::string& name) {
  auto method = [this, &obj, &name]() {
    Value self = obj;
    std::string m = name;
    return Value::MakeCallable(name, [this, self, m](CallArgs& a) { return CallMethod(self, m, a); });
  };
  switch (obj.kind) {
    case Kind::kUndefined:
      return UndefinedError(obj);
    case Kind::kDict: {
      if (HasMethod(obj, name)) return method();
      const Value* v = obj.dict->Find(name);
      if (v != nullptr) return *v;
      return Value::Undefined("'dict object' has no attribute '" + name + "'");
    }
    case Kind::kNamespace: {
      const Value* v = obj.ns->attrs.Find(name);
      if (v != nullptr) return *v;
      return Value::Undefined("'Namespace object' has no attribute '" + name + "'");
    }
    case Kind::kString:
    case Kind::kList:
      if (HasMethod(obj, name)) return method();
      break;
    default:
      break;
  }
  return NoAttribute(obj, "'" + name + "'");
}

StatusOr<Value> Renderer::GetItem(const Value& obj, const Value& key) {
  switch (obj.kind) {
    case Kind::kUndefined:
      return UndefinedError(obj);
    case Kind::kDict:
      if (key.is_string()) {
        const Value* v = obj.dict->Find(key.s);
        if (v != nullptr) return *v;
        return GetAttr(obj, key.s).value();
      }
      return Value::Undefined("'dict object' has no attribute " + Repr(key));
    case Kind::kList:
    case Kind::kString: {
      if (!key.is_integral()) {
        if (key.is_string()) return GetAttr(obj, key.s);
        return NoAttribute(obj, Repr(key));
      }
      int64_t i = key.as_int();
      if (obj.is_list()) {
        int64_t n = static_cast<int64_t>(obj.list->size());
        if (i < 0) i += n;
        if (i < 0 || i >= n) return Value::Undefined(TypeName(obj) + " index out of range");
        return (*obj.list)[i];
      }
      std::u32string u = DecodeUtf8(obj.s);
      int64_t n = static_cast<int64_t>(u.size());
      if (i < 0) i += n;
      if (i < 0 || i >= n) return Value::Undefined("string index out of range");
      std::string one;
      AppendUtf8(&one, u[i]);
      return Value::Str(std::move(one));
    }
    case Kind::kNamespace:
      if (key.is_string()) return GetAttr(obj, key.s);
      break;
    default:
      break;
  }
  return NoAttribute(obj, Repr(key));
}

StatusOr<Value> Renderer::Slice(const Expr& e, const Value& obj, const Value* start, const Value* stop,
                                const Value* step) {
  if (obj.is_undefined()) return Fail(e, UndefinedError(obj).message());
  if (!obj.is_list() && !obj.is_string()) {
    return Fail(e, std::string("'") + TypeName(obj) + "' object is not subscriptable");
  }
  auto as_index = [&](const Value* v, const char* what) -> StatusOr<std::optional<int64_t>> {
    if (v == nullptr || v->is_none()) return std::optional<int64_t>();
    if (!v->is_integral()) return Fail(e, std::string("slice ") + what + " must be an integer or None");
    return std::optional<int64_t>(v->as_int());
  };
  std::optional<int64_t> b, en, st;
  MLARUN_ASSIGN_OR_RETURN(b, as_index(start, "start"));
  MLARUN_ASSIGN_OR_RETURN(en, as_index(stop, "stop"));
  MLARUN_ASSIGN_OR_RETURN(st, as_index(step, "step"));
  int64_t stp = st.value_or(1);
  if (stp == 0) return Fail(e, "slice step cannot be zero");
  std::u32string u;
  int64_t n;
  if (obj.is_string()) {
    u = DecodeUtf8(obj.s);
    n = static_cast<int64_t>(u.size());
  } else {
    n = static_cast<int64_t>(obj.list->size());
  }
  // CPython's PySlice_AdjustIndices.
  auto adjust = [&](std::optional<int64_t> v, int64_t def) {
    if (!v) return def;
    int64_t x = *v;
    if (x < 0) {
      x += n;
      if (x < 0) x = stp < 0 ? -1 : 0;
    } else if (x >= n) {
      x = stp < 0 ? n - 1 : n;
    }
    return x;
  };
  int64_t lo = adjust(b, stp < 0 ? n - 1 : 0);
  int64_t hi = adjust(en, stp < 0 ? -1 : n);
  std::vector<int64_t> idx;
  if (stp > 0) {
    for (int64_t i = lo; i < hi; i += stp) idx.push_back(i);
  } else {
    for (int64_t i = lo; i > hi; i += stp) idx.push_back(i);
  }
  MLARUN_RETURN_IF_ERROR(Step(static_cast<int64_t>(idx.size())));
  if (obj.is_string()) {
    std::u32string r;
    for (int64_t i : idx) r.push_back(u[i]);
    return Value::Str(EncodeUtf8(r));
  }
  ValueList r;
  for (int64_t i : idx) r.push_back((*obj.list)[i]);
  return Value::List(std::move(r), obj.tuple);
}

StatusOr<Value> Renderer::CallValue(const Value& callee, CallArgs& args) {
  if (callee.is_undefined()) return UndefinedError(callee);
  if (callee.kind != Kind::kCallable) {
    return InvalidArgumentError("'", TypeName(callee), "' object is not callable");
  }
  MLARUN_RETURN_IF_ERROR(Step());
  return callee.fn->fn(args);
}

StatusOr<bool> Renderer::Contains(const Value& container, const Value& item) {
  switch (container.kind) {
    case Kind::kUndefined:
      return false;
    case Kind::kString:
      if (!item.is_string()) {
        return InvalidArgumentError("'in <string>' requires string as left operand, not ", TypeName(item));
      }
      return container.s.find(item.s) != std::string::npos;
    case Kind::kList:
      for (const Value& v : *container.list) {
        if (Equal(v, item)) return true;
      }
      return false;
    case Kind::kDict:
      return item.is_string() && container.dict->Find(item.s) != nullptr;
    default:
      return InvalidArgumentError("argument of type '", TypeName(container), "' is not iterable");
  }
}

// ----- operators -----

Status Renderer::Unsupported(const Expr& e, const Value& a, const Value& b) const {
  static const char* kSymbols[] = {"+", "-", "*", "/", "//", "%", "**", "~"};
  return Fail(e, std::string("unsupported operand type(s) for ") + kSymbols[static_cast<int>(e.op)] + ": '" +
                     TypeName(a) + "' and '" + TypeName(b) + "'");
}

StatusOr<Value> Renderer::EvalBinary(const Expr& e, const Value& a, const Value& b) {
  if (e.op == BinOp::kConcat) {
    std::string s = ToStr(a) + ToStr(b);
    MLARUN_RETURN_IF_ERROR(Charge(s.size()));
    return Value::Str(std::move(s));
  }
  if (a.is_undefined()) return Fail(e, UndefinedError(a).message());
  if (b.is_undefined()) return Fail(e, UndefinedError(b).message());
  const bool ints = a.is_integral() && b.is_integral();
  const bool nums = a.is_number() && b.is_number();
  switch (e.op) {
    case BinOp::kAdd:
      return Add(e, a, b);
    case BinOp::kSub:
      if (ints) {
        int64_t r;
        if (__builtin_sub_overflow(a.as_int(), b.as_int(), &r)) return Overflow(e);
        return Value::Int(r);
      }
      if (nums) return Value::Float(a.as_double() - b.as_double());
      return Unsupported(e, a, b);
    case BinOp::kMul:
      return Multiply(e, a, b);
    case BinOp::kDiv:
      if (!nums) return Unsupported(e, a, b);
      if (b.as_double() == 0) return Fail(e, "division by zero");
      return Value::Float(a.as_double() / b.as_double());
    case BinOp::kFloorDiv:
      if (!nums) return Unsupported(e, a, b);
      if (b.as_double() == 0) return Fail(e, "integer division or modulo by zero");
      if (ints) {
        if (a.as_int() == INT64_MIN && b.as_int() == -1) return Overflow(e);
        return Value::Int(FloorDiv(a.as_int(), b.as_int()));
      }
      return Value::Float(std::floor(a.as_double() / b.as_double()));
    case BinOp::kMod:
      return Modulo(e, a, b);
    case BinOp::kPow:
      return Power(e, a, b);
    case BinOp::kConcat:
      break;
  }
  return Unsupported(e, a, b);
}

// a + b: numbers, str + str, list + list (tuple + tuple).
StatusOr<Value> Renderer::Add(const Expr& e, const Value& a, const Value& b) {
  if (a.is_integral() && b.is_integral()) {
    int64_t r;
    if (__builtin_add_overflow(a.as_int(), b.as_int(), &r)) return Overflow(e);
    return Value::Int(r);
  }
  if (a.is_number() && b.is_number()) return Value::Float(a.as_double() + b.as_double());
  if (a.is_string() && b.is_string()) {
    MLARUN_RETURN_IF_ERROR(Charge(a.s.size() + b.s.size()));
    return Value::Str(a.s + b.s);
  }
  if (a.is_list() && b.is_list() && a.tuple == b.tuple) {
    ValueList r = *a.list;
    r.insert(r.end(), b.list->begin(), b.list->end());
    MLARUN_RETURN_IF_ERROR(Step(static_cast<int64_t>(r.size())));
    return Value::List(std::move(r), a.tuple);
  }
  if (a.is_string()) return Fail(e, "can only concatenate str (not \"" + TypeName(b) + "\") to str");
  if (a.is_list()) return Fail(e, "can only concatenate list (not \"" + TypeName(b) + "\") to list");
  return Unsupported(e, a, b);
}

// a * b: numbers, or a str or list repeated an integer number of times
// (either side).
StatusOr<Value> Renderer::Multiply(const Expr& e, const Value& a, const Value& b) {
  if (a.is_integral() && b.is_integral()) {
    int64_t r;
    if (__builtin_mul_overflow(a.as_int(), b.as_int(), &r)) return Overflow(e);
    return Value::Int(r);
  }
  if (a.is_number() && b.is_number()) return Value::Float(a.as_double() * b.as_double());
  const Value* seq = (a.is_string() || a.is_list()) && b.is_integral() ? &a : nullptr;
  const Value* times = &b;
  if (seq == nullptr && (b.is_string() || b.is_list()) && a.is_integral()) {
    seq = &b;
    times = &a;
  }
  if (seq == nullptr) return Unsupported(e, a, b);
  int64_t t = std::max<int64_t>(0, times->as_int());
  if (seq->is_string()) {
    if (!seq->s.empty() && t > static_cast<int64_t>(kMaxOutputBytes / seq->s.size())) {
      return Charge(kMaxOutputBytes + 1);
    }
    MLARUN_RETURN_IF_ERROR(Charge(seq->s.size() * static_cast<size_t>(t)));
    std::string r;
    r.reserve(seq->s.size() * static_cast<size_t>(t));
    for (int64_t k = 0; k < t; ++k) r += seq->s;
    return Value::Str(std::move(r));
  }
  if (!seq->list->empty() && t > kMaxRangeLength / static_cast<int64_t>(seq->list->size())) {
    return Step(kMaxSteps + 1);
  }
  ValueList r;
  for (int64_t k = 0; k < t; ++k) r.insert(r.end(), seq->list->begin(), seq->list->end());
  MLARUN_RETURN_IF_ERROR(Step(static_cast<int64_t>(r.size())));
  return Value::List(std::move(r), seq->tuple);
}

// a % b: `str % values`, or Python's modulo (the sign of b).
StatusOr<Value> Renderer::Modulo(const Expr& e, const Value& a, const Value& b) {
  if (a.is_string()) {
    auto r = PrintfFormat(a.s, b);
    if (!r.ok()) return Fail(e, r.status().message());
    MLARUN_RETURN_IF_ERROR(Charge(r->size()));
    return Value::Str(std::move(r).value());
  }
  if (!a.is_number() || !b.is_number()) return Unsupported(e, a, b);
  if (b.as_double() == 0) return Fail(e, "integer division or modulo by zero");
  if (a.is_integral() && b.is_integral()) {
    if (b.as_int() == -1) return Value::Int(0);
    return Value::Int(FloorMod(a.as_int(), b.as_int()));
  }
  double m = std::fmod(a.as_double(), b.as_double());
  if (m != 0 && ((m < 0) != (b.as_double() < 0))) m += b.as_double();
  return Value::Float(m);
}

// a ** b: an int for an int base and a non-negative int exponent (overflow
// is an error), else a float.
StatusOr<Value> Renderer::Power(const Expr& e, const Value& a, const Value& b) {
  if (!a.is_number() || !b.is_number()) return Unsupported(e, a, b);
  if (a.is_integral() && b.is_integral() && b.as_int() >= 0) {
    int64_t base = a.as_int(), r = 1;
    for (int64_t k = 0; k < b.as_int(); ++k) {
      if (__builtin_mul_overflow(r, base, &r)) return Overflow(e);
      if (r == 0 || r == 1) break;
      if (r == -1 && k < b.as_int()) {
        r = (b.as_int() % 2 == 0) ? 1 : -1;
        break;
      }
    }
    return Value::Int(r);
  }
  return Value::Float(std::pow(a.as_double(), b.as_double()));
}

// ----- filters, tests and attribute paths -----

StatusOr<Value> Renderer::EvalFilter(const Expr& e, const Value& block_input, const std::shared_ptr<Scope>& scope) {
  // The innermost operand of a {% filter %} block is a placeholder for the
  // block's text.
  Value input;
  if (e.children[0]->kind == ExprKind::kLiteral && e.children[0]->text == "(block)") {
    input = block_input;
  } else if (e.children[0]->kind == ExprKind::kFilter) {
    MLARUN_ASSIGN_OR_RETURN(input, EvalFilter(*e.children[0], block_input, scope));
  } else {
    MLARUN_ASSIGN_OR_RETURN(input, Eval(*e.children[0], scope));
  }
  CallArgs args;
  MLARUN_ASSIGN_OR_RETURN(args, EvalArgs(e, scope));
  auto r = ApplyFilter(e.name, input, args);
  if (!r.ok()) return Wrap(e, r.status());
  return r;
}

StatusOr<Value> Renderer::ApplyFilter(const std::string& name, const Value& input, CallArgs& args) {
  auto it = Filters().find(name);
  if (it == Filters().end()) return InvalidArgumentError("no filter named '", name, "'");
  MLARUN_RETURN_IF_ERROR(Step());
  return it->second(*this, input, args);
}

StatusOr<bool> Renderer::ApplyTest(const std::string& name, const Value& input, CallArgs& args) {
  auto it = Tests().find(name);
  if (it == Tests().end()) return InvalidArgumentError("no test named '", name, "'");
  MLARUN_RETURN_IF_ERROR(Step());
  return it->second(*this, input, args);
}

StatusOr<Value> Renderer::AttributePath(const Value& v, const Value& path) {
  if (path.is_integral()) return GetItem(v, path);
  Value cur = v;
  std::string p = ToStr(path);
  size_t pos = 0;
  while (true) {
    size_t dot = p.find('.', pos);
    std::string part = p.substr(pos, dot == std::string::npos ? std::string::npos : dot - pos);
    bool numeric = !part.empty() && std::all_of(part.begin(), part.end(), [](char c) { return c >= '0' && c <= '9'; });
    if (numeric) {
      MLARUN_ASSIGN_OR_RETURN(cur, GetItem(cur, Value::Int(std::stoll(part))));
    } else {
      MLARUN_ASSIGN_OR_RETURN(cur, GetItem(cur, Value::Str(part)));
    }
    if (dot == std::string::npos) break;
    pos = dot + 1;
  }
  return cur;
}

// ----- expressions -----

StatusOr<Value> Renderer::Eval(const Expr& e, const std::shared_ptr<Scope>& scope) {
  switch (e.kind) {
    case ExprKind::kLiteral:
      return e.literal;
    case ExprKind::kName:
      return EvalName(e, scope);
    case ExprKind::kList:
    case ExprKind::kTuple:
      return EvalSequence(e, scope);
    case ExprKind::kDict:
      return EvalDict(e, scope);
    case ExprKind::kAttr:
      return EvalAttr(e, scope);
    case ExprKind::kItem:
      return EvalItem(e, scope);
    case ExprKind::kSlice:
      return EvalSlice(e, scope);
    case ExprKind::kCall:
      return EvalCall(e, scope);
    case ExprKind::kFilter:
      return EvalFilter(e, Value(), scope);
    case ExprKind::kTest:
      return EvalTest(e, scope);
    case ExprKind::kNeg:
    case ExprKind::kPos:
      return EvalUnary(e, scope);
    case ExprKind::kNot: {
      Value v;
      MLARUN_ASSIGN_OR_RETURN(v, Eval(*e.children[0], scope));
      return Value::Bool(!Truthy(v));
    }
    case ExprKind::kAnd:
    case ExprKind::kOr: {
      Value a;
      MLARUN_ASSIGN_OR_RETURN(a, Eval(*e.children[0], scope));
      bool t = Truthy(a);
      if (e.kind == ExprKind::kAnd ? !t : t) return a;
      return Eval(*e.children[1], scope);
    }
    case ExprKind::kCond: {
      Value c;
      MLARUN_ASSIGN_OR_RETURN(c, Eval(*e.children[1], scope));
      if (Truthy(c)) return Eval(*e.children[0], scope);
      if (e.children[2]) return Eval(*e.children[2], scope);
      return Value::Undefined("the conditional expression `" + e.text + "` had no else branch");
    }
    case ExprKind::kBinary: {
      Value a, b;
      MLARUN_ASSIGN_OR_RETURN(a, Eval(*e.children[0], scope));
      MLARUN_ASSIGN_OR_RETURN(b, Eval(*e.children[1], scope));
      return EvalBinary(e, a, b);
    }
    case ExprKind::kCompare:
      return EvalCompare(e, scope);
  }
  return Fail(e, "unknown expression");
}

StatusOr<CallArgs> Renderer::EvalArgs(const Expr& e, const std::shared_ptr<Scope>& scope) {
  CallArgs args;
  for (size_t k = 1; k < e.children.size(); ++k) {
    Value v;
    MLARUN_ASSIGN_OR_RETURN(v, Eval(*e.children[k], scope));
    args.args.push_back(std::move(v));
  }
  for (const auto& [k, x] : e.kwargs) {
    Value v;
    MLARUN_ASSIGN_OR_RETURN(v, Eval(*x, scope));
    args.kwargs.emplace_back(k, std::move(v));
  }
  return args;
}

StatusOr<Value> Renderer::EvalName(const Expr& e, const std::shared_ptr<Scope>& scope) {
  for (Scope* s = scope.get(); s != nullptr; s = s->parent.get()) {
    auto it = s->vars.find(e.name);
    if (it != s->vars.end()) return it->second;
  }
  return Value::Undefined("'" + e.name + "' is undefined");
}

// [a, b] and (a, b).
StatusOr<Value> Renderer::EvalSequence(const Expr& e, const std::shared_ptr<Scope>& scope) {
  ValueList items;
  for (const auto& c : e.children) {
    Value v;
    MLARUN_ASSIGN_OR_RETURN(v, Eval(*c, scope));
    items.push_back(std::move(v));
  }
  return Value::List(std::move(items), e.kind == ExprKind::kTuple);
}

StatusOr<Value> Renderer::EvalDict(const Expr& e, const std::shared_ptr<Scope>& scope) {
  Dict d;
  for (size_t k = 0; k + 1 < e.children.size(); k += 2) {
    Value key, v;
    MLARUN_ASSIGN_OR_RETURN(key, Eval(*e.children[k], scope));
    MLARUN_ASSIGN_OR_RETURN(v, Eval(*e.children[k + 1], scope));
    if (!key.is_string()) return Fail(e, "only str keys are supported in dict literals");
    d.Set(key.s, std::move(v));
  }
  return Value::MakeDict(std::move(d));
}

StatusOr<Value> Renderer::EvalAttr(const Expr& e, const std::shared_ptr<Scope>& scope) {
  Value obj;
  MLARUN_ASSIGN_OR_RETURN(obj, Eval(*e.children[0], scope));
  auto r = GetAttr(obj, e.name);
  if (!r.ok()) return Wrap(e, r.status());
  return r;
}

StatusOr<Value> Renderer::EvalItem(const Expr& e, const std::shared_ptr<Scope>& scope) {
  Value obj, key;
  MLARUN_ASSIGN_OR_RETURN(obj, Eval(*e.children[0], scope));
  MLARUN_ASSIGN_OR_RETURN(key, Eval(*e.children[1], scope));
  auto r = GetItem(obj, key);
  if (!r.ok()) return Wrap(e, r.status());
  return r;
}

StatusOr<Value> Renderer::EvalSlice(const Expr& e, const std::shared_ptr<Scope>& scope) {
  Value obj;
  MLARUN_ASSIGN_OR_RETURN(obj, Eval(*e.children[0], scope));
  Value parts[3];
  const Value* ptrs[3] = {nullptr, nullptr, nullptr};
  for (int k = 0; k < 3; ++k) {
    if (e.children[k + 1]) {
      MLARUN_ASSIGN_OR_RETURN(parts[k], Eval(*e.children[k + 1], scope));
      ptrs[k] = &parts[k];
    }
  }
  return Slice(e, obj, ptrs[0], ptrs[1], ptrs[2]);
}

StatusOr<Value> Renderer::EvalCall(const Expr& e, const std::shared_ptr<Scope>& scope) {
  Value callee;
  MLARUN_ASSIGN_OR_RETURN(callee, Eval(*e.children[0], scope));
  CallArgs args;
  MLARUN_ASSIGN_OR_RETURN(args, EvalArgs(e, scope));
  auto r = CallValue(callee, args);
  if (!r.ok()) return Wrap(e, r.status());
  return r;
}

// x is [not] test(args).
StatusOr<Value> Renderer::EvalTest(const Expr& e, const std::shared_ptr<Scope>& scope) {
  Value input;
  MLARUN_ASSIGN_OR_RETURN(input, Eval(*e.children[0], scope));
  CallArgs args;
  MLARUN_ASSIGN_OR_RETURN(args, EvalArgs(e, scope));
  auto r = ApplyTest(e.name, input, args);
  if (!r.ok()) return Wrap(e, r.status());
  return Value::Bool(*r != e.negated);
}

// -x and +x.
StatusOr<Value> Renderer::EvalUnary(const Expr& e, const std::shared_ptr<Scope>& scope) {
  Value v;
  MLARUN_ASSIGN_OR_RETURN(v, Eval(*e.children[0], scope));
  if (v.is_undefined()) return Fail(e, UndefinedError(v).message());
  if (!v.is_number()) {
    return Fail(e, std::string("bad operand type for unary ") + (e.kind == ExprKind::kNeg ? "-" : "+") + ": '" +
                       TypeName(v) + "'");
  }
  if (e.kind == ExprKind::kPos) return v.kind == Kind::kBool ? Value::Int(v.as_int()) : v;
  if (v.kind == Kind::kFloat) return Value::Float(-v.f);
  if (v.as_int() == INT64_MIN) return Overflow(e);
  return Value::Int(-v.as_int());
}

// a < b <= c ...: each comparison in turn, false at the first that fails.
StatusOr<Value> Renderer::EvalCompare(const Expr& e, const std::shared_ptr<Scope>& scope) {
  Value left;
  MLARUN_ASSIGN_OR_RETURN(left, Eval(*e.children[0], scope));
  for (size_t k = 0; k < e.cmp_ops.size(); ++k) {
    Value right;
    MLARUN_ASSIGN_OR_RETURN(right, Eval(*e.children[k + 1], scope));
    bool r = false;
    CmpOp op = e.cmp_ops[k];
    if (op == CmpOp::kEq || op == CmpOp::kNe) {
      r = Equal(left, right) == (op == CmpOp::kEq);
    } else if (op == CmpOp::kIn || op == CmpOp::kNotIn) {
      auto c = Contains(right, left);
      if (!c.ok()) return Wrap(e, c.status());
      r = *c == (op == CmpOp::kIn);
    } else {
      if (left.is_undefined()) return Fail(e, UndefinedError(left).message());
      if (right.is_undefined()) return Fail(e, UndefinedError(right).message());
      auto c = Compare(left, right);
      if (!c.ok()) {
        static const char* kSym[] = {"==", "!=", "<", "<=", ">", ">=", "in", "not in"};
        std::string msg = c.status().message();
        size_t q = msg.find("'<'");
        if (q != std::string::npos) msg.replace(q, 3, std::string("'") + kSym[static_cast<int>(op)] + "'");
        return Fail(e, msg);
      }
      int cv = *c;
      r = op == CmpOp::kLt ? cv < 0 : op == CmpOp::kLe ? cv <= 0 : op == CmpOp::kGt ? cv > 0 : cv >= 0;
    }
    if (!r) return Value::Bool(false);
    left = std::move(right);
  }
  return Value::Bool(true);
}

}  // namespace mlarun::text::jinja
