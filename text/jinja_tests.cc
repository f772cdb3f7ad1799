// The tests (`x is [not] name(args)`), as jinja2 defines them; Tests() maps
// each name to its function.
#include <string>
#include <unordered_map>

#include "text/jinja_runtime.h"

namespace mlarun::text::jinja {
namespace {

StatusOr<bool> TDefined(Renderer&, const Value& v, CallArgs&) { return !v.is_undefined(); }
StatusOr<bool> TUndefined(Renderer&, const Value& v, CallArgs&) { return v.is_undefined(); }
StatusOr<bool> TNone(Renderer&, const Value& v, CallArgs&) { return v.is_none(); }
StatusOr<bool> TString(Renderer&, const Value& v, CallArgs&) { return v.is_string(); }
StatusOr<bool> TNumber(Renderer&, const Value& v, CallArgs&) { return v.is_number(); }
StatusOr<bool> TInteger(Renderer&, const Value& v, CallArgs&) { return v.kind == Kind::kInt; }
StatusOr<bool> TFloat(Renderer&, const Value& v, CallArgs&) { return v.kind == Kind::kFloat; }
StatusOr<bool> TBoolean(Renderer&, const Value& v, CallArgs&) { return v.kind == Kind::kBool; }
StatusOr<bool> TTrue(Renderer&, const Value& v, CallArgs&) { return v.kind == Kind::kBool && v.b; }
StatusOr<bool> TFalse(Renderer&, const Value& v, CallArgs&) { return v.kind == Kind::kBool && !v.b; }
StatusOr<bool> TMapping(Renderer&, const Value& v, CallArgs&) { return v.is_dict(); }
StatusOr<bool> TIterable(Renderer&, const Value& v, CallArgs&) {
  return v.is_undefined() || v.is_string() || v.is_list() || v.is_dict();
}
StatusOr<bool> TSequence(Renderer&, const Value& v, CallArgs&) {
  return v.is_undefined() || v.is_string() || v.is_list() || v.is_dict();
}
StatusOr<bool> TCallable(Renderer&, const Value& v, CallArgs&) { return v.kind == Kind::kCallable; }
StatusOr<bool> TEscaped(Renderer&, const Value&, CallArgs&) { return false; }

StatusOr<const Value*> Other(const CallArgs& a) {
  const Value* o = Arg(a, 0, "other");
  if (o == nullptr) return InvalidArgumentError("the test needs a value to compare with");
  return o;
}
StatusOr<bool> TEq(Renderer&, const Value& v, CallArgs& a) {
  const Value* o;
  MLARUN_ASSIGN_OR_RETURN(o, Other(a));
  return Equal(v, *o);
}
StatusOr<bool> TNe(Renderer&, const Value& v, CallArgs& a) {
  const Value* o;
  MLARUN_ASSIGN_OR_RETURN(o, Other(a));
  return !Equal(v, *o);
}
template <int kWhich>  // 0 <, 1 <=, 2 >, 3 >=
StatusOr<bool> TOrder(Renderer&, const Value& v, CallArgs& a) {
  const Value* o;
  MLARUN_ASSIGN_OR_RETURN(o, Other(a));
  int c;
  MLARUN_ASSIGN_OR_RETURN(c, Compare(v, *o));
  return kWhich == 0 ? c < 0 : kWhich == 1 ? c <= 0 : kWhich == 2 ? c > 0 : c >= 0;
}
StatusOr<bool> TIn(Renderer& r, const Value& v, CallArgs& a) {
  const Value* o;
  MLARUN_ASSIGN_OR_RETURN(o, Other(a));
  return r.Contains(*o, v);
}
StatusOr<bool> TSameAs(Renderer&, const Value& v, CallArgs& a) {
  const Value* o;
  MLARUN_ASSIGN_OR_RETURN(o, Other(a));
  if (v.kind != o->kind) return false;
  switch (v.kind) {
    case Kind::kList:
      return v.list == o->list;
    case Kind::kDict:
      return v.dict == o->dict;
    case Kind::kNamespace:
      return v.ns == o->ns;
    case Kind::kCallable:
      return v.fn == o->fn;
    default:
      return Equal(v, *o);
  }
}
StatusOr<bool> TOddEven(const Value& v, bool odd) {
  if (v.is_undefined()) return InvalidArgumentError(v.s);
  if (!v.is_integral()) return InvalidArgumentError("odd/even need an integer, not ", TypeName(v));
  return (FloorMod(v.as_int(), 2) == 1) == odd;
}
StatusOr<bool> TOdd(Renderer&, const Value& v, CallArgs&) { return TOddEven(v, true); }
StatusOr<bool> TEven(Renderer&, const Value& v, CallArgs&) { return TOddEven(v, false); }
StatusOr<bool> TDivisibleBy(Renderer&, const Value& v, CallArgs& a) {
  const Value* o = Arg(a, 0, "num");
  if (o == nullptr || !o->is_integral() || !v.is_integral()) return InvalidArgumentError("divisibleby needs integers");
  if (o->as_int() == 0) return InvalidArgumentError("integer division or modulo by zero");
  return FloorMod(v.as_int(), o->as_int()) == 0;
}
StatusOr<bool> TLower(Renderer& r, const Value& v, CallArgs&) {
  CallArgs none;
  Value b;
  MLARUN_ASSIGN_OR_RETURN(b, r.CallMethod(Value::Str(ToStr(v)), "islower", none));
  return b.b;
}
StatusOr<bool> TUpper(Renderer& r, const Value& v, CallArgs&) {
  CallArgs none;
  Value b;
  MLARUN_ASSIGN_OR_RETURN(b, r.CallMethod(Value::Str(ToStr(v)), "isupper", none));
  return b.b;
}

}  // namespace

const std::unordered_map<std::string, TestFn>& Tests() {
  static const auto* tests = new std::unordered_map<std::string, TestFn>{
      {"defined", TDefined},
      {"undefined", TUndefined},
      {"none", TNone},
      {"string", TString},
      {"number", TNumber},
      {"integer", TInteger},
      {"float", TFloat},
      {"boolean", TBoolean},
      {"true", TTrue},
      {"false", TFalse},
      {"mapping", TMapping},
      {"iterable", TIterable},
      {"sequence", TSequence},
      {"callable", TCallable},
      {"escaped", TEscaped},
      {"eq", TEq},
      {"equalto", TEq},
      {"==", TEq},
      {"ne", TNe},
      {"!=", TNe},
      {"lt", TOrder<0>},
      {"lessthan", TOrder<0>},
      {"<", TOrder<0>},
      {"le", TOrder<1>},
      {"<=", TOrder<1>},
      {"gt", TOrder<2>},
      {"greaterthan", TOrder<2>},
      {">", TOrder<2>},
      {"ge", TOrder<3>},
      {">=", TOrder<3>},
      {"in", TIn},
      {"sameas", TSameAs},
      {"odd", TOdd},
      {"even", TEven},
      {"divisibleby", TDivisibleBy},
      {"lower", TLower},
      {"upper", TUpper},
  };
  return *tests;
}

bool IsKnownTest(const std::string& name) { return Tests().count(name) > 0; }

}  // namespace mlarun::text::jinja
