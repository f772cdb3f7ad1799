// The renderer's statements, and the argument and arithmetic helpers the
// other phases share (see jinja_runtime.h).
#include "text/jinja_runtime.h"

#include <algorithm>

namespace mlarun::text::jinja {
namespace {

// Errors a template raises itself (raise_exception) or that already name
// their expression pass through the call sites unchanged.
bool Named(const Status& s) { return s.message().rfind("chat template", 0) == 0; }

}  // namespace

Status Renderer::Wrap(const Expr& e, const Status& s) const {
  if (Named(s) || s.code() != StatusCode::kInvalidArgument) return s;
  return Fail(e, s.message());
}

// ----- arguments and arithmetic -----

const Value* Arg(const CallArgs& a, size_t pos, const char* name) {
  if (pos < a.args.size()) return &a.args[pos];
  for (const auto& [k, v] : a.kwargs) {
    if (k == name) return &v;
  }
  return nullptr;
}

StatusOr<int64_t> IntArg(const Value* v, int64_t def, const char* what) {
  if (v == nullptr || v->is_none()) return def;
  if (!v->is_integral()) return InvalidArgumentError(what, " must be an integer, not ", TypeName(*v));
  return v->as_int();
}

StatusOr<std::string> StrArg(const Value* v, const char* what) {
  if (v == nullptr) return InvalidArgumentError(what, " is missing");
  if (!v->is_string()) return InvalidArgumentError(what, " must be a str, not ", TypeName(*v));
  return v->s;
}

int64_t FloorDiv(int64_t a, int64_t b) {
  int64_t q = a / b;
  if ((a % b != 0) && ((a < 0) != (b < 0))) --q;
  return q;
}
int64_t FloorMod(int64_t a, int64_t b) {
  int64_t m = a % b;
  if (m != 0 && ((m < 0) != (b < 0))) m += b;
  return m;
}

// ----- statements -----

Status Renderer::Exec(const NodeList& nodes, const std::shared_ptr<Scope>& scope, std::string* out) {
  for (const auto& np : nodes) {
    const Node& n = *np;
    MLARUN_RETURN_IF_ERROR(Step());
    switch (n.kind) {
      case NodeKind::kText:
        MLARUN_RETURN_IF_ERROR(Append(out, n.text));
        break;
      case NodeKind::kOutput: {
        Value v;
        MLARUN_ASSIGN_OR_RETURN(v, Eval(*n.expr, scope));
        MLARUN_RETURN_IF_ERROR(Append(out, ToStr(v)));
        break;
      }
      case NodeKind::kIf: {
        const NodeList* chosen = &n.else_body;
        for (const auto& [cond, body] : n.branches) {
          Value c;
          MLARUN_ASSIGN_OR_RETURN(c, Eval(*cond, scope));
          if (Truthy(c)) {
            chosen = &body;
            break;
          }
        }
        MLARUN_RETURN_IF_ERROR(Exec(*chosen, scope, out));
        break;
      }
      case NodeKind::kFor:
        MLARUN_RETURN_IF_ERROR(ExecFor(n, scope, out));
        break;
      case NodeKind::kSet:
        MLARUN_RETURN_IF_ERROR(ExecSet(n, scope));
        break;
      case NodeKind::kSetBlock: {
        std::string text;
        MLARUN_RETURN_IF_ERROR(Exec(n.body, scope, &text));
        if (n.expr) {
          Value v;
          MLARUN_ASSIGN_OR_RETURN(v, EvalFilter(*n.expr, Value::Str(std::move(text)), scope));
          scope->vars[n.targets[0]] = std::move(v);
        } else {
          scope->vars[n.targets[0]] = Value::Str(std::move(text));
        }
        break;
      }
      case NodeKind::kMacro:
        MLARUN_RETURN_IF_ERROR(ExecMacro(n, scope));
        break;
      case NodeKind::kBreak:
        flow_ = Flow::kBreak;
        return Status::Ok();
      case NodeKind::kContinue:
        flow_ = Flow::kContinue;
        return Status::Ok();
      case NodeKind::kWith: {
        auto inner = std::make_shared<Scope>();
        inner->parent = scope;
        for (size_t k = 0; k < n.targets.size(); ++k) {
          Value v;
          MLARUN_ASSIGN_OR_RETURN(v, Eval(*n.values[k], scope));
          MLARUN_RETURN_IF_ERROR(CheckDepth(v, n.line));
          inner->vars[n.targets[k]] = std::move(v);
        }
        MLARUN_RETURN_IF_ERROR(Exec(n.body, inner, out));
        break;
      }
      case NodeKind::kFilterBlock: {
        std::string text;
        MLARUN_RETURN_IF_ERROR(Exec(n.body, scope, &text));
        Value v;
        MLARUN_ASSIGN_OR_RETURN(v, EvalFilter(*n.expr, Value::Str(std::move(text)), scope));
        MLARUN_RETURN_IF_ERROR(Append(out, ToStr(v)));
        break;
      }
      case NodeKind::kScope:
        MLARUN_RETURN_IF_ERROR(Exec(n.body, scope, out));
        break;
    }
    if (flow_ != Flow::kNormal) return Status::Ok();
  }
  return Status::Ok();
}

// {% set targets = expr %}, or {% set ns.attr = expr %} on a namespace().
Status Renderer::ExecSet(const Node& n, const std::shared_ptr<Scope>& scope) {
  Value v;
  MLARUN_ASSIGN_OR_RETURN(v, Eval(*n.expr, scope));
  MLARUN_RETURN_IF_ERROR(CheckDepth(v, n.line));
  if (n.attr.empty()) return Assign(n, n.targets, n.unpack, v, scope.get());
  Value target = Value::Undefined("'" + n.targets[0] + "' is undefined");
  for (Scope* s = scope.get(); s != nullptr; s = s->parent.get()) {
    auto it = s->vars.find(n.targets[0]);
    if (it != s->vars.end()) {
      target = it->second;
      break;
    }
  }
  if (target.kind != Kind::kNamespace) {
    return InvalidArgumentError("chat template line ", n.line, ": {% set ", n.targets[0], ".", n.attr,
                                " %}: cannot assign an attribute of a ", TypeName(target), " (only of a namespace())");
  }
  target.ns->attrs.Set(n.attr, std::move(v));
  return Status::Ok();
}

Status Renderer::Assign(const Node& n, const std::vector<std::string>& targets, bool unpack, const Value& v,
                        Scope* scope) {
  if (!unpack) {
    scope->vars[targets[0]] = v;
    return Status::Ok();
  }
  ValueList items;
  if (v.is_undefined()) {
    return InvalidArgumentError("chat template line ", n.line, ": cannot unpack an undefined value (", v.s, ")");
  }
  MLARUN_ASSIGN_OR_RETURN(items, Iterate(v));
  if (items.size() != targets.size()) {
    return InvalidArgumentError("chat template line ", n.line, ": cannot unpack ", items.size(), " values into ",
                                targets.size(), " names");
  }
  for (size_t k = 0; k < targets.size(); ++k) scope->vars[targets[k]] = items[k];
  return Status::Ok();
}

Status Renderer::ExecFor(const Node& n, const std::shared_ptr<Scope>& scope, std::string* out) {
  Value seq;
  MLARUN_ASSIGN_OR_RETURN(seq, Eval(*n.expr, scope));
  // A list is iterated in place (no copy); other iterables are listed first.
  std::shared_ptr<const ValueList> listed;
  if (seq.is_list()) {
    listed = seq.list;
  } else {
    auto r = Iterate(seq);
    if (!r.ok()) return Wrap(*n.expr, r.status());
    listed = std::make_shared<const ValueList>(std::move(r).value());
  }
  if (n.cond) {
    ValueList kept;
    for (const Value& item : *listed) {
      MLARUN_RETURN_IF_ERROR(Step());
      auto s = std::make_shared<Scope>();
      s->parent = scope;
      MLARUN_RETURN_IF_ERROR(Assign(n, n.targets, n.unpack, item, s.get()));
      Value c;
      MLARUN_ASSIGN_OR_RETURN(c, Eval(*n.cond, s));
      if (Truthy(c)) kept.push_back(item);
    }
    listed = std::make_shared<const ValueList>(std::move(kept));
  }
  const ValueList& items = *listed;
  if (items.empty()) {
    auto s = std::make_shared<Scope>();
    s->parent = scope;
    return Exec(n.else_body, s, out);
  }
  const int64_t length = static_cast<int64_t>(items.size());
  // The loop object: built once, then copied and updated per iteration (its
  // keys in this fixed order).
  enum : size_t { kIndex, kIndex0, kRevindex, kRevindex0, kFirst, kLast, kPrev, kNext };
  auto position = std::make_shared<int64_t>(0);
  Dict proto;
  for (const char* key : {"index", "index0", "revindex", "revindex0", "first", "last", "previtem", "nextitem"}) {
    proto.items.emplace_back(key, Value());
  }
  proto.items.emplace_back("length", Value::Int(length));
  proto.items.emplace_back("depth", Value::Int(1));
  proto.items.emplace_back("depth0", Value::Int(0));
  proto.items.emplace_back("cycle", Value::MakeCallable("loop.cycle", [position](CallArgs& a) -> StatusOr<Value> {
                             if (a.args.empty()) return InvalidArgumentError("loop.cycle() needs at least one value");
                             return a.args[static_cast<size_t>(*position) % a.args.size()];
                           }));
  for (int64_t k = 0; k < length; ++k) {
    MLARUN_RETURN_IF_ERROR(Step());
    auto s = std::make_shared<Scope>();
    s->parent = scope;
    MLARUN_RETURN_IF_ERROR(Assign(n, n.targets, n.unpack, items[k], s.get()));
    *position = k;
    Dict loop = proto;
    loop.items[kIndex].second = Value::Int(k + 1);
    loop.items[kIndex0].second = Value::Int(k);
    loop.items[kRevindex].second = Value::Int(length - k);
    loop.items[kRevindex0].second = Value::Int(length - k - 1);
    loop.items[kFirst].second = Value::Bool(k == 0);
    loop.items[kLast].second = Value::Bool(k == length - 1);
    loop.items[kPrev].second = k > 0 ? items[k - 1] : Value::Undefined("there is no previous item");
    loop.items[kNext].second = k + 1 < length ? items[k + 1] : Value::Undefined("there is no next item");
    s->vars["loop"] = Value::MakeDict(std::move(loop));
    MLARUN_RETURN_IF_ERROR(Exec(n.body, s, out));
    if (flow_ == Flow::kBreak) {
      flow_ = Flow::kNormal;
      break;
    }
    flow_ = Flow::kNormal;
  }
  return Status::Ok();
}

Status Renderer::ExecMacro(const Node& n, const std::shared_ptr<Scope>& scope) {
  std::weak_ptr<Scope> defined_in = scope;
  const Node* node = &n;
  Renderer* self = this;
  scope->vars[n.name] = Value::MakeCallable(
      n.name,
      [self, node, defined_in](CallArgs& a) -> StatusOr<Value> {
        std::shared_ptr<Scope> parent = defined_in.lock();
        if (!parent) {
          return InvalidArgumentError("chat template line ", node->line, ": macro '", node->name,
                                      "' was called after its scope ended");
        }
        if (a.args.size() > node->params.size()) {
          return InvalidArgumentError("chat template line ", node->line, ": macro '", node->name,
                                      "' takes not more than ", node->params.size(), " argument(s)");
        }
        if (++self->call_depth_ > kMaxCallDepth) {
          --self->call_depth_;
          return ResourceExhaustedError("chat template: macro calls nest deeper than ", kMaxCallDepth,
                                        "; a runaway template?");
        }
        MLARUN_RETURN_IF_ERROR(self->Step());
        auto s = std::make_shared<Scope>();
        s->parent = parent;
        for (const auto& [k, v] : a.kwargs) {
          if (std::find(node->params.begin(), node->params.end(), k) == node->params.end()) {
            --self->call_depth_;
            return InvalidArgumentError("chat template line ", node->line, ": macro '", node->name,
                                        "' has no parameter named '", k, "'");
          }
        }
        for (size_t p = 0; p < node->params.size(); ++p) {
          const Value* given = p < a.args.size() ? &a.args[p] : nullptr;
          for (const auto& [k, v] : a.kwargs) {
            if (k == node->params[p]) given = &v;
          }
          if (given != nullptr) {
            if (Status st = CheckDepth(*given, node->line); !st.ok()) {
              --self->call_depth_;
              return st;
            }
            s->vars[node->params[p]] = *given;
          } else if (node->defaults[p]) {
            auto d = self->Eval(*node->defaults[p], s);
            if (!d.ok()) {
              --self->call_depth_;
              return d.status();
            }
            s->vars[node->params[p]] = std::move(d).value();
          } else {
            s->vars[node->params[p]] =
                Value::Undefined("parameter '" + node->params[p] + "' of macro '" + node->name + "' was not given");
          }
        }
        std::string text;
        Status st = self->Exec(node->body, s, &text);
        self->flow_ = Flow::kNormal;
        --self->call_depth_;
        if (!st.ok()) return st;
        return Value::Str(std::move(text));
      },
      /*is_macro=*/true);
  return Status::Ok();
}

}  // namespace mlarun::text::jinja
