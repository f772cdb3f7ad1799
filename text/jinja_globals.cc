// The template's globals: raise_exception, strftime_now (the local time, as
// transformers defines it), namespace(), dict() and range().
#include <ctime>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "text/jinja_runtime.h"

namespace mlarun::text::jinja {

void Renderer::InstallGlobals(Scope* root) {
  Renderer* self = this;
  root->vars["raise_exception"] = Value::MakeCallable("raise_exception", [](CallArgs& a) -> StatusOr<Value> {
    std::string msg = a.args.empty() ? "" : ToStr(a.args[0]);
    return Status(StatusCode::kInvalidArgument, "chat template raised an error: " + msg);
  });
  root->vars["strftime_now"] = Value::MakeCallable("strftime_now", [](CallArgs& a) -> StatusOr<Value> {
    const Value* fmt = Arg(a, 0, "format");
    if (fmt == nullptr || !fmt->is_string()) return InvalidArgumentError("strftime_now needs a format string");
    std::time_t now = std::time(nullptr);
    std::tm tm{};
    localtime_r(&now, &tm);
    std::vector<char> buf(256 + fmt->s.size() * 8);
    size_t n = std::strftime(buf.data(), buf.size(), fmt->s.c_str(), &tm);
    return Value::Str(std::string(buf.data(), n));
  });
  root->vars["namespace"] = Value::MakeCallable("namespace", [self](CallArgs& a) -> StatusOr<Value> {
    Value v;
    v.kind = Kind::kNamespace;
    v.ns = std::make_shared<Namespace>();
    self->namespaces_.push_back(v.ns);
    for (const Value& init : a.args) {
      if (!init.is_dict()) return InvalidArgumentError("namespace() takes keyword arguments or a dict");
      for (const auto& [k, x] : init.dict->items) v.ns->attrs.Set(k, x);
    }
    for (const auto& [k, x] : a.kwargs) v.ns->attrs.Set(k, x);
    return v;
  });
  root->vars["dict"] = Value::MakeCallable("dict", [](CallArgs& a) -> StatusOr<Value> {
    Dict d;
    for (const Value& init : a.args) {
      if (!init.is_dict()) return InvalidArgumentError("dict() takes keyword arguments or a dict");
      for (const auto& [k, x] : init.dict->items) d.Set(k, x);
    }
    for (const auto& [k, x] : a.kwargs) d.Set(k, x);
    return Value::MakeDict(std::move(d));
  });
  root->vars["range"] = Value::MakeCallable("range", [self](CallArgs& a) -> StatusOr<Value> {
    if (a.args.empty() || a.args.size() > 3) return InvalidArgumentError("range expected 1 to 3 arguments");
    for (const Value& x : a.args) {
      if (!x.is_integral()) {
        return InvalidArgumentError("'", TypeName(x), "' object cannot be interpreted as an integer");
      }
    }
    int64_t start = 0, stop, step = 1;
    if (a.args.size() == 1) {
      stop = a.args[0].as_int();
    } else {
      start = a.args[0].as_int();
      stop = a.args[1].as_int();
      if (a.args.size() == 3) step = a.args[2].as_int();
    }
    if (step == 0) return InvalidArgumentError("range() arg 3 must not be zero");
    __int128 count = step > 0 ? (static_cast<__int128>(stop) - start + step - 1) / step
                              : (static_cast<__int128>(start) - stop - step - 1) / -step;
    if (count < 0) count = 0;
    if (count > kMaxRangeLength) {
      return ResourceExhaustedError("chat template: range() of ", static_cast<int64_t>(count),
                                    " items is more than the ", kMaxRangeLength, " allowed; a runaway template?");
    }
    MLARUN_RETURN_IF_ERROR(self->Step(static_cast<int64_t>(count)));
    ValueList out;
    out.reserve(static_cast<size_t>(count));
    for (int64_t k = 0; k < static_cast<int64_t>(count); ++k) out.push_back(Value::Int(start + k * step));
    return Value::List(std::move(out));
  });
}

}  // namespace mlarun::text::jinja
