#include "text/jinja_parse.h"

#include <cerrno>
#include <cstdlib>
#include <set>

namespace mlarun::text::jinja {
namespace {

// Nesting bounds: a template nests a handful of levels; these only keep a
// hostile one from exhausting the stack while it is parsed.
constexpr int kMaxExprDepth = 200;
constexpr int kMaxBlockDepth = 200;

enum class TokType { kName, kInt, kFloat, kString, kOp, kEnd };

struct Token {
  TokType type = TokType::kEnd;
  std::string text;  // name, operator, or a string literal's decoded value
  int64_t int_value = 0;
  double float_value = 0;
  size_t begin = 0, end = 0;  // source offsets
  int line = 0;
};

enum class SegType { kText, kVar, kBlock };

struct Segment {
  SegType type = SegType::kText;
  std::string text;
  std::vector<Token> tokens;  // ends with a kEnd token
  int line = 0;
};

Status SyntaxError(int line, const std::string& what) {
  return InvalidArgumentError("chat template line ", line, ": ", what, kRenderYourselfHint);
}

bool IsNameStart(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }
bool IsNameChar(char c) { return IsNameStart(c) || (c >= '0' && c <= '9'); }
bool IsDigit(char c) { return c >= '0' && c <= '9'; }
bool IsTagSpace(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\f' || c == '\v'; }

std::string RStripPy(const std::string& s) {
  std::u32string u = DecodeUtf8(s);
  while (!u.empty() && IsPyWhitespace(u.back())) u.pop_back();
  return EncodeUtf8(u);
}

class Lexer {
 public:
  explicit Lexer(const std::string& source) {
    // jinja2 normalizes newlines to \n and drops one trailing newline.
    src_.reserve(source.size());
    for (size_t i = 0; i < source.size(); ++i) {
      if (source[i] == '\r') {
        src_.push_back('\n');
        if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
      } else {
        src_.push_back(source[i]);
      }
    }
    if (!src_.empty() && src_.back() == '\n') src_.pop_back();
  }

  const std::string& source() const { return src_; }

  StatusOr<std::vector<Segment>> Run() {
    std::vector<Segment> segs;
    size_t pos = 0;
    while (pos <= src_.size()) {
      size_t p = FindTag(pos);
      std::string text = src_.substr(pos, (p == std::string::npos ? src_.size() : p) - pos);
      bool line_starting = pos == 0 || src_[pos - 1] == '\n';
      if (p == std::string::npos) {
        AddText(&segs, std::move(text), LineAt(pos));
        break;
      }
      char kind = src_[p + 1];  // '{', '%' or '#'
      char sign = p + 2 < src_.size() ? src_[p + 2] : '\0';
      if (sign == '-') {
        text = RStripPy(text);
      } else if (sign != '+' && kind != '{') {
        LStripBlock(&text, line_starting);
      }
      AddText(&segs, std::move(text), LineAt(pos));
      size_t q = p + 2 + ((sign == '-' || sign == '+') ? 1 : 0);
      int line = LineAt(p);
      if (kind == '#') {
        size_t e = src_.find("#}", q);
        if (e == std::string::npos) return SyntaxError(line, "a comment ({# ... #}) is not closed");
        bool strip = e > q && src_[e - 1] == '-';
        bool keep = e > q && src_[e - 1] == '+';
        pos = AfterTag(e + 2, strip, !keep);
        continue;
      }
      Segment seg;
      seg.type = kind == '{' ? SegType::kVar : SegType::kBlock;
      seg.line = line;
      bool strip_after = false, keep_after = false;
      size_t after = 0;
      MLARUN_RETURN_IF_ERROR(Tokenize(q, seg.type, &seg.tokens, &after, &strip_after, &keep_after));
      if (seg.type == SegType::kBlock && seg.tokens.size() == 2 && seg.tokens[0].type == TokType::kName &&
          seg.tokens[0].text == "raw") {
        MLARUN_ASSIGN_OR_RETURN(pos, Raw(AfterTag(after, strip_after, !keep_after), line, &segs));
        continue;
      }
      pos = AfterTag(after, strip_after, seg.type == SegType::kBlock && !keep_after);
      segs.push_back(std::move(seg));
    }
    return segs;
  }

 private:
  int LineAt(size_t pos) {
    // Lines are counted forward only: the lexer never looks back far.
    while (line_pos_ < pos && line_pos_ < src_.size()) {
      if (src_[line_pos_] == '\n') ++line_;
      ++line_pos_;
    }
    if (pos < line_pos_) {
      int line = 1;
      for (size_t i = 0; i < pos; ++i) line += src_[i] == '\n';
      return line;
    }
    return line_;
  }

  size_t FindTag(size_t from) const {
    size_t p = from;
    while (true) {
      p = src_.find('{', p);
      if (p == std::string::npos || p + 1 >= src_.size()) return std::string::npos;
      char c = src_[p + 1];
      if (c == '{' || c == '%' || c == '#') return p;
      ++p;
    }
  }

  // lstrip_blocks: spaces and tabs between the line's start and the tag go.
  static void LStripBlock(std::string* text, bool line_starting) {
    size_t nl = text->rfind('\n');
    size_t l = nl == std::string::npos ? 0 : nl + 1;
    if (l == 0 && !line_starting) return;
    for (size_t i = l; i < text->size(); ++i) {
      char c = (*text)[i];
      if (c != ' ' && c != '\t' && c != '\f' && c != '\v') return;
    }
    text->resize(l);
  }

  // Where the text after a tag starts: `-%}` eats all whitespace, trim_blocks
  // one newline.
  size_t AfterTag(size_t pos, bool strip, bool trim_newline) const {
    if (strip) {
      std::u32string rest;
      while (pos < src_.size()) {
        size_t len = 1;
        unsigned char c = static_cast<unsigned char>(src_[pos]);
        if (c >= 0xF0) {
          len = 4;
        } else if (c >= 0xE0) {
          len = 3;
        } else if (c >= 0xC0) {
          len = 2;
        }
        std::u32string cp = DecodeUtf8(src_.substr(pos, len));
        if (cp.size() != 1 || !IsPyWhitespace(cp[0])) break;
        pos += len;
      }
      return pos;
    }
    if (trim_newline && pos < src_.size() && src_[pos] == '\n') return pos + 1;
    return pos;
  }

  static void AddText(std::vector<Segment>* segs, std::string text, int line) {
    if (text.empty()) return;
    Segment seg;
    seg.type = SegType::kText;
    seg.text = std::move(text);
    seg.line = line;
    segs->push_back(std::move(seg));
  }

  // {% raw %}...{% endraw %}: the text in between, verbatim.
  StatusOr<size_t> Raw(size_t pos, int line, std::vector<Segment>* segs) {
    size_t p = pos;
    while (true) {
      p = src_.find("{%", p);
      if (p == std::string::npos) return SyntaxError(line, "{% raw %} has no {% endraw %}");
      size_t q = p + 2;
      char sign = q < src_.size() ? src_[q] : '\0';
      if (sign == '-' || sign == '+') ++q;
      while (q < src_.size() && IsTagSpace(src_[q])) ++q;
      if (src_.compare(q, 6, "endraw") != 0) {
        p += 2;
        continue;
      }
      q += 6;
      while (q < src_.size() && IsTagSpace(src_[q])) ++q;
      char end_sign = q < src_.size() ? src_[q] : '\0';
      if (end_sign == '-' || end_sign == '+') ++q;
      if (src_.compare(q, 2, "%}") != 0) {
        p += 2;
        continue;
      }
      std::string text = src_.substr(pos, p - pos);
      if (sign == '-') {
        text = RStripPy(text);
      } else if (sign != '+') {
        LStripBlock(&text, pos == 0 || src_[pos - 1] == '\n');
      }
      AddText(segs, std::move(text), LineAt(pos));
      return AfterTag(q + 2, end_sign == '-', end_sign != '+');
    }
  }

  // The tokens of a tag's inside, from `pos` to its `}}` or `%}` (outside
  // brackets, as jinja2 only ends a tag once they balance).
  Status Tokenize(size_t pos, SegType type, std::vector<Token>* out, size_t* after, bool* strip, bool* keep) {
    const char* close = type == SegType::kVar ? "}}" : "%}";
    int depth = 0;
    int start_line = LineAt(pos);
    while (true) {
      while (pos < src_.size() && IsTagSpace(src_[pos])) ++pos;
      if (pos >= src_.size()) {
        return SyntaxError(start_line,
                           type == SegType::kVar ? "a {{ ... }} is not closed" : "a {% ... %} is not closed");
      }
      if (depth == 0) {
        if ((src_[pos] == '-' || src_[pos] == '+') && src_.compare(pos + 1, 2, close) == 0) {
          *strip = src_[pos] == '-';
          *keep = src_[pos] == '+';
          *after = pos + 3;
          break;
        }
        if (src_.compare(pos, 2, close) == 0) {
          *after = pos + 2;
          break;
        }
      }
      Token tok;
      tok.begin = pos;
      tok.line = LineAt(pos);
      char c = src_[pos];
      if (IsNameStart(c)) {
        size_t e = pos;
        while (e < src_.size() && IsNameChar(src_[e])) ++e;
        tok.type = TokType::kName;
        tok.text = src_.substr(pos, e - pos);
        pos = e;
      } else if (IsDigit(c)) {
        MLARUN_RETURN_IF_ERROR(Number(&pos, &tok));
      } else if (c == '\'' || c == '"') {
        MLARUN_RETURN_IF_ERROR(String(&pos, &tok));
      } else {
        static const char* kOps[] = {"//", "**", "==", "!=", "<=", ">=", "+", "-", "*", "/", "%", "~", "<",
                                     ">",  "=",  "(",  ")",  "[",  "]",  "{", "}", ",", ".", ":", "|", ";"};
        const char* found = nullptr;
        for (const char* op : kOps) {
          if (src_.compare(pos, std::char_traits<char>::length(op), op) == 0) {
            found = op;
            break;
          }
        }
        if (found == nullptr) {
          return SyntaxError(tok.line, std::string("unexpected character '") + c + "'");
        }
        tok.type = TokType::kOp;
        tok.text = found;
        pos += tok.text.size();
        if (tok.text == "(" || tok.text == "[" || tok.text == "{") ++depth;
        if ((tok.text == ")" || tok.text == "]" || tok.text == "}") && depth > 0) --depth;
      }
      tok.end = pos;
      out->push_back(std::move(tok));
    }
    Token end;
    end.type = TokType::kEnd;
    end.begin = end.end = *after;
    end.line = LineAt(*after);
    out->push_back(end);
    return Status::Ok();
  }

  Status Number(size_t* pos, Token* tok) {
    size_t p = *pos;
    std::string digits;
    auto take_digits = [&]() {
      while (p < src_.size() && (IsDigit(src_[p]) || (src_[p] == '_' && p + 1 < src_.size() && IsDigit(src_[p + 1])))) {
        if (src_[p] != '_') digits += src_[p];
        ++p;
      }
    };
    take_digits();
    bool is_float = false;
    if (p + 1 < src_.size() && src_[p] == '.' && IsDigit(src_[p + 1])) {
      is_float = true;
      digits += '.';
      ++p;
      take_digits();
    }
    if (p < src_.size() && (src_[p] == 'e' || src_[p] == 'E')) {
      size_t q = p + 1;
      if (q < src_.size() && (src_[q] == '+' || src_[q] == '-')) ++q;
      if (q < src_.size() && IsDigit(src_[q])) {
        is_float = true;
        digits += 'e';
        digits.append(src_, p + 1, q - p - 1);
        p = q;
        take_digits();
      }
    }
    tok->text = src_.substr(*pos, p - *pos);
    if (is_float) {
      tok->type = TokType::kFloat;
      tok->float_value = std::strtod(digits.c_str(), nullptr);
    } else {
      tok->type = TokType::kInt;
      errno = 0;
      long long v = std::strtoll(digits.c_str(), nullptr, 10);
      if (errno == ERANGE) return SyntaxError(tok->line, "the integer " + tok->text + " is too large");
      tok->int_value = v;
    }
    *pos = p;
    return Status::Ok();
  }

  // A string literal with Python's escapes (jinja2 decodes them with
  // unicode-escape): \n \t \r \\ \' \" \a \b \f \v \0-\777 \xHH \uHHHH
  // \UHHHHHHHH; any other backslash stays.
  Status String(size_t* pos, Token* tok) {
    char quote = src_[*pos];
    size_t p = *pos + 1;
    std::string out;
    auto hex = [&](size_t start, int n, char32_t* cp) {
      if (start + n > src_.size()) return false;
      *cp = 0;
      for (int k = 0; k < n; ++k) {
        char h = src_[start + k];
        int d = (h >= '0' && h <= '9')   ? h - '0'
                : (h >= 'a' && h <= 'f') ? h - 'a' + 10
                : (h >= 'A' && h <= 'F') ? h - 'A' + 10
                                         : -1;
        if (d < 0) return false;
        *cp = *cp * 16 + d;
      }
      return true;
    };
    while (true) {
      if (p >= src_.size()) return SyntaxError(tok->line, "a string literal is not closed");
      char c = src_[p];
      if (c == quote) {
        ++p;
        break;
      }
      if (c != '\\') {
        out += c;
        ++p;
        continue;
      }
      if (p + 1 >= src_.size()) return SyntaxError(tok->line, "a string literal is not closed");
      char e = src_[p + 1];
      p += 2;
      char32_t cp = 0;
      switch (e) {
        case 'n':
          out += '\n';
          break;
        case 't':
          out += '\t';
          break;
        case 'r':
          out += '\r';
          break;
        case '\\':
          out += '\\';
          break;
        case '\'':
          out += '\'';
          break;
        case '"':
          out += '"';
          break;
        case 'a':
          out += '\a';
          break;
        case 'b':
          out += '\b';
          break;
        case 'f':
          out += '\f';
          break;
        case 'v':
          out += '\v';
          break;
        case '\n':
          break;
        case 'x':
          if (!hex(p, 2, &cp)) return SyntaxError(tok->line, "a bad \\x escape in a string literal");
          AppendUtf8(&out, cp);
          p += 2;
          break;
        case 'u':
          if (!hex(p, 4, &cp)) return SyntaxError(tok->line, "a bad \\u escape in a string literal");
          AppendUtf8(&out, cp);
          p += 4;
          break;
        case 'U':
          if (!hex(p, 8, &cp) || cp > 0x10FFFF) return SyntaxError(tok->line, "a bad \\U escape in a string literal");
          AppendUtf8(&out, cp);
          p += 8;
          break;
        default:
          if (e >= '0' && e <= '7') {
            cp = e - '0';
            for (int k = 0; k < 2 && p < src_.size() && src_[p] >= '0' && src_[p] <= '7'; ++k)
              cp = cp * 8 + (src_[p++] - '0');
            AppendUtf8(&out, cp);
          } else {
            out += '\\';
            out += e;
          }
      }
    }
    tok->type = TokType::kString;
    tok->text = std::move(out);
    *pos = p;
    return Status::Ok();
  }

  std::string src_;
  size_t line_pos_ = 0;
  int line_ = 1;
};

// Constructs jinja2 has that the interpreter does not: refused by name.
const std::set<std::string>& RefusedTags() {
  static const auto* tags = new std::set<std::string>{
      "include", "extends",    "import",        "from",  "block",    "endblock",  "call",  "endcall",
      "do",      "autoescape", "endautoescape", "trans", "endtrans", "pluralize", "print", "debug"};
  return *tags;
}

class Parser {
 public:
  Parser(const std::string& src, std::vector<Segment> segs) : src_(src), segs_(std::move(segs)) {}

  StatusOr<NodeList> Run() {
    NodeList nodes;
    std::string stop;
    MLARUN_RETURN_IF_ERROR(Body({}, &nodes, &stop));
    return nodes;
  }

 private:
  // ----- statements -----

  // Parses nodes until a block tag whose name is in `ends` (left current, its
  // name in *stop), or the end of the template when `ends` is empty.
  Status Body(const std::set<std::string>& ends, NodeList* out, std::string* stop) {
    if (++block_depth_ > kMaxBlockDepth) return SyntaxError(CurLine(), "blocks nest too deeply");
    while (seg_ < segs_.size()) {
      Segment& seg = segs_[seg_];
      if (seg.type == SegType::kText) {
        auto node = std::make_unique<Node>();
        node->kind = NodeKind::kText;
        node->line = seg.line;
        node->text = seg.text;
        out->push_back(std::move(node));
        ++seg_;
        continue;
      }
      toks_ = &seg.tokens;
      tok_ = 0;
      if (seg.type == SegType::kVar) {
        auto node = std::make_unique<Node>();
        node->kind = NodeKind::kOutput;
        node->line = seg.line;
        MLARUN_ASSIGN_OR_RETURN(node->expr, Tuple(true, false));
        MLARUN_RETURN_IF_ERROR(ExpectEnd());
        out->push_back(std::move(node));
        ++seg_;
        continue;
      }
      const Token& first = Cur();
      if (first.type != TokType::kName) return SyntaxError(seg.line, "a {% ... %} tag must start with a tag name");
      if (ends.count(first.text)) {
        *stop = first.text;
        --block_depth_;
        return Status::Ok();
      }
      MLARUN_RETURN_IF_ERROR(Statement(out));
    }
    if (!ends.empty()) {
      std::string names;
      for (const auto& e : ends) names += (names.empty() ? "" : " or ") + std::string("{% ") + e + " %}";
      return SyntaxError(open_line_, "the template ended where " + names + " was expected");
    }
    --block_depth_;
    return Status::Ok();
  }

  Status Statement(NodeList* out) {
    const Segment& seg = segs_[seg_];
    std::string tag = Cur().text;
    int line = seg.line;
    if (tag == "if") return If(out);
    if (tag == "for") return For(out);
    if (tag == "set") return Set(out);
    if (tag == "macro") return Macro(out);
    if (tag == "with") return With(out);
    if (tag == "filter") return FilterBlock(out);
    if (tag == "generation") {
      // transformers' {% generation %}: marks the assistant's tokens; renders
      // its body.
      Next();
      MLARUN_RETURN_IF_ERROR(ExpectEnd());
      auto node = std::make_unique<Node>();
      node->kind = NodeKind::kScope;
      node->line = line;
      ++seg_;
      std::string stop;
      open_line_ = line;
      MLARUN_RETURN_IF_ERROR(Body({"endgeneration"}, &node->body, &stop));
      MLARUN_RETURN_IF_ERROR(EndTag());
      out->push_back(std::move(node));
      return Status::Ok();
    }
    if (tag == "break" || tag == "continue") {
      if (loop_depth_ == 0) return SyntaxError(line, "{% " + tag + " %} outside a loop");
      Next();
      MLARUN_RETURN_IF_ERROR(ExpectEnd());
      auto node = std::make_unique<Node>();
      node->kind = tag == "break" ? NodeKind::kBreak : NodeKind::kContinue;
      node->line = line;
      out->push_back(std::move(node));
      ++seg_;
      return Status::Ok();
    }
    if (RefusedTags().count(tag)) {
      return InvalidArgumentError("chat template line ", line, ": {% ", tag,
                                  " %} is not supported by mlarun's chat template interpreter", kRenderYourselfHint);
    }
    static const std::set<std::string> kStray = {"endif",    "elif",    "else",      "endfor",        "endset",
                                                 "endmacro", "endwith", "endfilter", "endgeneration", "endraw"};
    if (kStray.count(tag)) return SyntaxError(line, "{% " + tag + " %} without its opening tag");
    return InvalidArgumentError("chat template line ", line, ": unknown tag {% ", tag, " %}", kRenderYourselfHint);
  }

  // The tag that closes a block: `{% endX %}` with nothing after the name.
  Status EndTag() {
    Next();
    MLARUN_RETURN_IF_ERROR(ExpectEnd());
    ++seg_;
    return Status::Ok();
  }

  Status If(NodeList* out) {
    auto node = std::make_unique<Node>();
    node->kind = NodeKind::kIf;
    node->line = segs_[seg_].line;
    int open = node->line;
    while (true) {
      Next();  // `if` / `elif`
      std::unique_ptr<Expr> cond;
      MLARUN_ASSIGN_OR_RETURN(cond, Tuple(false, false));
      MLARUN_RETURN_IF_ERROR(ExpectEnd());
      ++seg_;
      NodeList body;
      std::string stop;
      open_line_ = open;
      MLARUN_RETURN_IF_ERROR(Body({"elif", "else", "endif"}, &body, &stop));
      node->branches.emplace_back(std::move(cond), std::move(body));
      if (stop == "elif") continue;
      if (stop == "else") {
        Next();
        MLARUN_RETURN_IF_ERROR(ExpectEnd());
        ++seg_;
        open_line_ = open;
        MLARUN_RETURN_IF_ERROR(Body({"endif"}, &node->else_body, &stop));
      }
      break;
    }
    MLARUN_RETURN_IF_ERROR(EndTag());
    out->push_back(std::move(node));
    return Status::Ok();
  }

  // Names assigned to: `x`, `k, v`, `(k, v)`.
  Status Targets(Node* node) {
    bool paren = IsOp("(");
    if (paren) Next();
    while (true) {
      if (Cur().type != TokType::kName) return SyntaxError(Cur().line, "expected a variable name, got " + Describe());
      node->targets.push_back(Cur().text);
      Next();
      if (!IsOp(",")) break;
      node->unpack = true;
      Next();
      if (paren && IsOp(")")) break;
    }
    if (paren) MLARUN_RETURN_IF_ERROR(ExpectOp(")"));
    for (const auto& t : node->targets) {
      if (t == "true" || t == "false" || t == "none" || t == "True" || t == "False" || t == "None") {
        return SyntaxError(Cur().line, "cannot assign to " + t);
      }
    }
    return Status::Ok();
  }

  Status For(NodeList* out) {
    auto node = std::make_unique<Node>();
    node->kind = NodeKind::kFor;
    node->line = segs_[seg_].line;
    int open = node->line;
    Next();
    MLARUN_RETURN_IF_ERROR(Targets(node.get()));
    if (!IsName("in")) return SyntaxError(Cur().line, "expected 'in' in {% for %}, got " + Describe());
    Next();
    MLARUN_ASSIGN_OR_RETURN(node->expr, Tuple(false, false));
    if (IsName("if")) {
      Next();
      MLARUN_ASSIGN_OR_RETURN(node->cond, Expression(true));
    }
    if (IsName("recursive")) {
      return InvalidArgumentError("chat template line ", node->line,
                                  ": recursive loops ({% for ... recursive %}) are not supported by mlarun's chat "
                                  "template interpreter",
                                  kRenderYourselfHint);
    }
    MLARUN_RETURN_IF_ERROR(ExpectEnd());
    ++seg_;
    std::string stop;
    ++loop_depth_;
    open_line_ = open;
    MLARUN_RETURN_IF_ERROR(Body({"else", "endfor"}, &node->body, &stop));
    --loop_depth_;
    if (stop == "else") {
      Next();
      MLARUN_RETURN_IF_ERROR(ExpectEnd());
      ++seg_;
      open_line_ = open;
      MLARUN_RETURN_IF_ERROR(Body({"endfor"}, &node->else_body, &stop));
    }
    MLARUN_RETURN_IF_ERROR(EndTag());
    out->push_back(std::move(node));
    return Status::Ok();
  }

  Status Set(NodeList* out) {
    auto node = std::make_unique<Node>();
    node->line = segs_[seg_].line;
    Next();
    if (Cur().type == TokType::kName && Peek().type == TokType::kOp && Peek().text == ".") {
      node->targets.push_back(Cur().text);
      Next();
      Next();
      if (Cur().type != TokType::kName) return SyntaxError(Cur().line, "expected an attribute name, got " + Describe());
      node->attr = Cur().text;
      Next();
    } else {
      MLARUN_RETURN_IF_ERROR(Targets(node.get()));
    }
    if (IsOp("=")) {
      Next();
      node->kind = NodeKind::kSet;
      MLARUN_ASSIGN_OR_RETURN(node->expr, Tuple(true, false));
      MLARUN_RETURN_IF_ERROR(ExpectEnd());
      ++seg_;
      out->push_back(std::move(node));
      return Status::Ok();
    }
    if (!node->attr.empty() || node->unpack) return SyntaxError(Cur().line, "expected '=' in {% set %}");
    if (IsOp("|")) {  // {% set x | filter %}: the filters apply to the body's text
      Next();
      MLARUN_ASSIGN_OR_RETURN(node->expr, FilterChain(node->line));
    }
    MLARUN_RETURN_IF_ERROR(ExpectEnd());
    node->kind = NodeKind::kSetBlock;
    ++seg_;
    std::string stop;
    open_line_ = node->line;
    MLARUN_RETURN_IF_ERROR(Body({"endset"}, &node->body, &stop));
    MLARUN_RETURN_IF_ERROR(EndTag());
    out->push_back(std::move(node));
    return Status::Ok();
  }

  Status Macro(NodeList* out) {
    auto node = std::make_unique<Node>();
    node->kind = NodeKind::kMacro;
    node->line = segs_[seg_].line;
    Next();
    if (Cur().type != TokType::kName) return SyntaxError(Cur().line, "expected a macro name, got " + Describe());
    node->name = Cur().text;
    Next();
    MLARUN_RETURN_IF_ERROR(ExpectOp("("));
    while (!IsOp(")")) {
      if (IsOp("*") || IsOp("**")) {
        return InvalidArgumentError("chat template line ", node->line,
                                    ": macro varargs/kwargs are not supported by mlarun's chat template interpreter",
                                    kRenderYourselfHint);
      }
      if (Cur().type != TokType::kName) return SyntaxError(Cur().line, "expected a parameter name, got " + Describe());
      node->params.push_back(Cur().text);
      Next();
      std::unique_ptr<Expr> def;
      if (IsOp("=")) {
        Next();
        MLARUN_ASSIGN_OR_RETURN(def, Expression(true));
      }
      node->defaults.push_back(std::move(def));
      if (!IsOp(",")) break;
      Next();
    }
    MLARUN_RETURN_IF_ERROR(ExpectOp(")"));
    MLARUN_RETURN_IF_ERROR(ExpectEnd());
    ++seg_;
    std::string stop;
    int saved_loops = loop_depth_;
    loop_depth_ = 0;
    open_line_ = node->line;
    MLARUN_RETURN_IF_ERROR(Body({"endmacro"}, &node->body, &stop));
    loop_depth_ = saved_loops;
    MLARUN_RETURN_IF_ERROR(EndTag());
    out->push_back(std::move(node));
    return Status::Ok();
  }

  Status With(NodeList* out) {
    auto node = std::make_unique<Node>();
    node->kind = NodeKind::kWith;
    node->line = segs_[seg_].line;
    Next();
    while (!IsEnd()) {
      if (Cur().type != TokType::kName) return SyntaxError(Cur().line, "expected a variable name, got " + Describe());
      node->targets.push_back(Cur().text);
      Next();
      MLARUN_RETURN_IF_ERROR(ExpectOp("="));
      std::unique_ptr<Expr> value;
      MLARUN_ASSIGN_OR_RETURN(value, Expression(true));
      node->values.push_back(std::move(value));
      if (!IsOp(",")) break;
      Next();
    }
    MLARUN_RETURN_IF_ERROR(ExpectEnd());
    ++seg_;
    std::string stop;
    open_line_ = node->line;
    MLARUN_RETURN_IF_ERROR(Body({"endwith"}, &node->body, &stop));
    MLARUN_RETURN_IF_ERROR(EndTag());
    out->push_back(std::move(node));
    return Status::Ok();
  }

  // {% filter name(args) | name2 %}: the filters applied to the body's text,
  // kept as a kFilter chain over a placeholder literal.
  Status FilterBlock(NodeList* out) {
    auto node = std::make_unique<Node>();
    node->kind = NodeKind::kFilterBlock;
    node->line = segs_[seg_].line;
    Next();
    MLARUN_ASSIGN_OR_RETURN(node->expr, FilterChain(node->line));
    MLARUN_RETURN_IF_ERROR(ExpectEnd());
    ++seg_;
    std::string stop;
    open_line_ = node->line;
    MLARUN_RETURN_IF_ERROR(Body({"endfilter"}, &node->body, &stop));
    MLARUN_RETURN_IF_ERROR(EndTag());
    out->push_back(std::move(node));
    return Status::Ok();
  }

  // `name(args) | name2 ...` over a placeholder for a block's text (a
  // kLiteral whose text is "(block)").
  StatusOr<std::unique_ptr<Expr>> FilterChain(int line) {
    auto input = std::make_unique<Expr>();
    input->kind = ExprKind::kLiteral;
    input->line = line;
    input->text = "(block)";
    std::unique_ptr<Expr> chain = std::move(input);
    while (true) {
      MLARUN_ASSIGN_OR_RETURN(chain, Filter(std::move(chain), Cur().begin));
      if (!IsOp("|")) break;
      Next();
    }
    return chain;
  }

  // ----- expressions (jinja2's grammar and precedence) -----

  const Token& Cur() const { return (*toks_)[tok_]; }
  const Token& Peek() const { return (*toks_)[std::min(tok_ + 1, toks_->size() - 1)]; }
  void Next() {
    if (tok_ + 1 < toks_->size()) ++tok_;
  }
  bool IsEnd() const { return Cur().type == TokType::kEnd; }
  bool IsOp(const char* op) const { return Cur().type == TokType::kOp && Cur().text == op; }
  bool IsName(const char* name) const { return Cur().type == TokType::kName && Cur().text == name; }
  int CurLine() const { return toks_ ? Cur().line : 1; }
  std::string Describe() const {
    switch (Cur().type) {
      case TokType::kEnd:
        return "the end of the tag";
      case TokType::kString:
        return "a string";
      default:
        return "'" + Cur().text + "'";
    }
  }
  Status ExpectOp(const char* op) {
    if (!IsOp(op)) return SyntaxError(Cur().line, std::string("expected '") + op + "', got " + Describe());
    Next();
    return Status::Ok();
  }
  Status ExpectEnd() {
    if (!IsEnd()) return SyntaxError(Cur().line, "unexpected " + Describe());
    return Status::Ok();
  }

  std::unique_ptr<Expr> Make(ExprKind kind, size_t /*begin: set by Finish*/, int line) {
    auto e = std::make_unique<Expr>();
    e->kind = kind;
    e->line = line;
    return e;
  }
  // The source text from `begin` to the last token consumed.
  void Finish(Expr* e, size_t begin) {
    size_t end = tok_ > 0 ? (*toks_)[tok_ - 1].end : begin;
    if (end < begin) end = begin;
    e->text = src_.substr(begin, end - begin);
  }

  struct DepthGuard {
    int* depth;
    explicit DepthGuard(int* d) : depth(d) { ++*depth; }
    ~DepthGuard() { --*depth; }
  };

  // `a, b` as a tuple where jinja2 allows one (output, set, for ... in).
  StatusOr<std::unique_ptr<Expr>> Tuple(bool with_condexpr, bool explicit_parens) {
    size_t begin = Cur().begin;
    int line = Cur().line;
    std::vector<std::unique_ptr<Expr>> items;
    bool is_tuple = false;
    while (true) {
      if (!items.empty()) {
        if (!IsOp(",")) break;
        is_tuple = true;
        Next();
        if (IsEnd() || IsOp(")") || (!with_condexpr && IsName("if")) || IsName("recursive")) break;
      }
      if (explicit_parens && IsOp(")") && items.empty()) {
        is_tuple = true;
        break;
      }
      std::unique_ptr<Expr> e;
      MLARUN_ASSIGN_OR_RETURN(e, Expression(with_condexpr));
      items.push_back(std::move(e));
    }
    if (!is_tuple) return std::move(items[0]);
    auto t = Make(ExprKind::kTuple, begin, line);
    t->children = std::move(items);
    Finish(t.get(), begin);
    return t;
  }

  StatusOr<std::unique_ptr<Expr>> Expression(bool with_condexpr) {
    DepthGuard guard(&expr_depth_);
    if (expr_depth_ > kMaxExprDepth) return SyntaxError(Cur().line, "the expression nests too deeply");
    if (with_condexpr) return CondExpr();
    return Or();
  }

  StatusOr<std::unique_ptr<Expr>> CondExpr() {
    size_t begin = Cur().begin;
    int line = Cur().line;
    std::unique_ptr<Expr> e;
    MLARUN_ASSIGN_OR_RETURN(e, Or());
    while (IsName("if")) {
      Next();
      auto c = Make(ExprKind::kCond, begin, line);
      std::unique_ptr<Expr> cond;
      MLARUN_ASSIGN_OR_RETURN(cond, Or());
      std::unique_ptr<Expr> other;
      if (IsName("else")) {
        Next();
        MLARUN_ASSIGN_OR_RETURN(other, CondExpr());
      }
      c->children.push_back(std::move(e));
      c->children.push_back(std::move(cond));
      c->children.push_back(std::move(other));
      Finish(c.get(), begin);
      e = std::move(c);
    }
    return e;
  }

  StatusOr<std::unique_ptr<Expr>> Or() {
    size_t begin = Cur().begin;
    int line = Cur().line;
    std::unique_ptr<Expr> e;
    MLARUN_ASSIGN_OR_RETURN(e, And());
    while (IsName("or")) {
      Next();
      auto o = Make(ExprKind::kOr, begin, line);
      std::unique_ptr<Expr> r;
      MLARUN_ASSIGN_OR_RETURN(r, And());
      o->children.push_back(std::move(e));
      o->children.push_back(std::move(r));
      Finish(o.get(), begin);
      e = std::move(o);
    }
    return e;
  }

  StatusOr<std::unique_ptr<Expr>> And() {
    size_t begin = Cur().begin;
    int line = Cur().line;
    std::unique_ptr<Expr> e;
    MLARUN_ASSIGN_OR_RETURN(e, Not());
    while (IsName("and")) {
      Next();
      auto a = Make(ExprKind::kAnd, begin, line);
      std::unique_ptr<Expr> r;
      MLARUN_ASSIGN_OR_RETURN(r, Not());
      a->children.push_back(std::move(e));
      a->children.push_back(std::move(r));
      Finish(a.get(), begin);
      e = std::move(a);
    }
    return e;
  }

  StatusOr<std::unique_ptr<Expr>> Not() {
    DepthGuard guard(&expr_depth_);
    if (expr_depth_ > kMaxExprDepth) return SyntaxError(Cur().line, "the expression nests too deeply");
    size_t begin = Cur().begin;
    int line = Cur().line;
    if (IsName("not")) {
      Next();
      auto n = Make(ExprKind::kNot, begin, line);
      std::unique_ptr<Expr> operand;
      MLARUN_ASSIGN_OR_RETURN(operand, Not());
      n->children.push_back(std::move(operand));
      Finish(n.get(), begin);
      return n;
    }
    return Compare();
  }

  StatusOr<std::unique_ptr<Expr>> Compare() {
    size_t begin = Cur().begin;
    int line = Cur().line;
    std::unique_ptr<Expr> e;
    MLARUN_ASSIGN_OR_RETURN(e, Math1());
    std::unique_ptr<Expr> cmp;
    while (true) {
      CmpOp op;
      if (IsOp("==")) {
        op = CmpOp::kEq;
      } else if (IsOp("!=")) {
        op = CmpOp::kNe;
      } else if (IsOp("<")) {
        op = CmpOp::kLt;
      } else if (IsOp("<=")) {
        op = CmpOp::kLe;
      } else if (IsOp(">")) {
        op = CmpOp::kGt;
      } else if (IsOp(">=")) {
        op = CmpOp::kGe;
      } else if (IsName("in")) {
        op = CmpOp::kIn;
      } else if (IsName("not") && Peek().type == TokType::kName && Peek().text == "in") {
        op = CmpOp::kNotIn;
        Next();
      } else {
        break;
      }
      Next();
      if (!cmp) {
        cmp = Make(ExprKind::kCompare, begin, line);
        cmp->children.push_back(std::move(e));
      }
      std::unique_ptr<Expr> r;
      MLARUN_ASSIGN_OR_RETURN(r, Math1());
      cmp->cmp_ops.push_back(op);
      cmp->children.push_back(std::move(r));
    }
    if (!cmp) return e;
    Finish(cmp.get(), begin);
    return cmp;
  }

  template <typename Sub>
  StatusOr<std::unique_ptr<Expr>> BinaryLevel(Sub sub, std::initializer_list<std::pair<const char*, BinOp>> ops) {
    size_t begin = Cur().begin;
    int line = Cur().line;
    std::unique_ptr<Expr> e;
    MLARUN_ASSIGN_OR_RETURN(e, (this->*sub)());
    while (true) {
      const std::pair<const char*, BinOp>* found = nullptr;
      for (const auto& op : ops) {
        if (IsOp(op.first)) found = &op;
      }
      if (found == nullptr) break;
      Next();
      auto b = Make(ExprKind::kBinary, begin, line);
      b->op = found->second;
      std::unique_ptr<Expr> r;
      MLARUN_ASSIGN_OR_RETURN(r, (this->*sub)());
      b->children.push_back(std::move(e));
      b->children.push_back(std::move(r));
      Finish(b.get(), begin);
      e = std::move(b);
    }
    return e;
  }

  StatusOr<std::unique_ptr<Expr>> Math1() {
    return BinaryLevel(&Parser::Concat, {{"+", BinOp::kAdd}, {"-", BinOp::kSub}});
  }
  StatusOr<std::unique_ptr<Expr>> Concat() { return BinaryLevel(&Parser::Math2, {{"~", BinOp::kConcat}}); }
  StatusOr<std::unique_ptr<Expr>> Math2() {
    return BinaryLevel(&Parser::Pow,
                       {{"*", BinOp::kMul}, {"/", BinOp::kDiv}, {"//", BinOp::kFloorDiv}, {"%", BinOp::kMod}});
  }
  StatusOr<std::unique_ptr<Expr>> Pow() { return BinaryLevel(&Parser::UnaryWithFilters, {{"**", BinOp::kPow}}); }
  StatusOr<std::unique_ptr<Expr>> UnaryWithFilters() { return Unary(true); }

  StatusOr<std::unique_ptr<Expr>> Unary(bool with_filter) {
    DepthGuard guard(&expr_depth_);
    if (expr_depth_ > kMaxExprDepth) return SyntaxError(Cur().line, "the expression nests too deeply");
    size_t begin = Cur().begin;
    int line = Cur().line;
    std::unique_ptr<Expr> e;
    if (IsOp("-") || IsOp("+")) {
      bool neg = IsOp("-");
      Next();
      e = Make(neg ? ExprKind::kNeg : ExprKind::kPos, begin, line);
      std::unique_ptr<Expr> operand;
      MLARUN_ASSIGN_OR_RETURN(operand, Unary(false));
      e->children.push_back(std::move(operand));
      Finish(e.get(), begin);
    } else {
      MLARUN_ASSIGN_OR_RETURN(e, Primary());
    }
    MLARUN_ASSIGN_OR_RETURN(e, Postfix(std::move(e), begin));
    if (with_filter) {
      MLARUN_ASSIGN_OR_RETURN(e, FilterExpr(std::move(e), begin));
    }
    return e;
  }

  StatusOr<std::unique_ptr<Expr>> Primary() {
    size_t begin = Cur().begin;
    int line = Cur().line;
    const Token& t = Cur();
    if (t.type == TokType::kName) {
      auto e = Make(ExprKind::kLiteral, begin, line);
      if (t.text == "true" || t.text == "True") {
        e->literal = Value::Bool(true);
      } else if (t.text == "false" || t.text == "False") {
        e->literal = Value::Bool(false);
      } else if (t.text == "none" || t.text == "None") {
        e->literal = Value::None();
      } else {
        e->kind = ExprKind::kName;
        e->name = t.text;
      }
      Next();
      Finish(e.get(), begin);
      return e;
    }
    if (t.type == TokType::kString) {
      std::string s;
      while (Cur().type == TokType::kString) {  // adjacent literals join
        s += Cur().text;
        Next();
      }
      auto e = Make(ExprKind::kLiteral, begin, line);
      e->literal = Value::Str(std::move(s));
      Finish(e.get(), begin);
      return e;
    }
    if (t.type == TokType::kInt || t.type == TokType::kFloat) {
      auto e = Make(ExprKind::kLiteral, begin, line);
      e->literal = t.type == TokType::kInt ? Value::Int(t.int_value) : Value::Float(t.float_value);
      Next();
      Finish(e.get(), begin);
      return e;
    }
    if (IsOp("(")) {
      Next();
      std::unique_ptr<Expr> e;
      MLARUN_ASSIGN_OR_RETURN(e, Tuple(true, true));
      MLARUN_RETURN_IF_ERROR(ExpectOp(")"));
      return e;
    }
    if (IsOp("[")) {
      Next();
      auto e = Make(ExprKind::kList, begin, line);
      while (!IsOp("]")) {
        std::unique_ptr<Expr> item;
        MLARUN_ASSIGN_OR_RETURN(item, Expression(true));
        e->children.push_back(std::move(item));
        if (!IsOp(",")) break;
        Next();
      }
      MLARUN_RETURN_IF_ERROR(ExpectOp("]"));
      Finish(e.get(), begin);
      return e;
    }
    if (IsOp("{")) {
      Next();
      auto e = Make(ExprKind::kDict, begin, line);
      while (!IsOp("}")) {
        std::unique_ptr<Expr> key, value;
        MLARUN_ASSIGN_OR_RETURN(key, Expression(true));
        MLARUN_RETURN_IF_ERROR(ExpectOp(":"));
        MLARUN_ASSIGN_OR_RETURN(value, Expression(true));
        e->children.push_back(std::move(key));
        e->children.push_back(std::move(value));
        if (!IsOp(",")) break;
        Next();
      }
      MLARUN_RETURN_IF_ERROR(ExpectOp("}"));
      Finish(e.get(), begin);
      return e;
    }
    if (IsEnd()) return SyntaxError(t.line, "an expression was expected before the end of the tag");
    return SyntaxError(t.line, "unexpected " + Describe() + " in an expression");
  }

  StatusOr<std::unique_ptr<Expr>> Postfix(std::unique_ptr<Expr> e, size_t begin) {
    while (true) {
      int line = Cur().line;
      if (IsOp(".")) {
        Next();
        if (Cur().type == TokType::kName) {
          auto a = Make(ExprKind::kAttr, begin, line);
          a->name = Cur().text;
          Next();
          a->children.push_back(std::move(e));
          Finish(a.get(), begin);
          e = std::move(a);
        } else if (Cur().type == TokType::kInt) {
          auto a = Make(ExprKind::kItem, begin, line);
          auto idx = Make(ExprKind::kLiteral, Cur().begin, line);
          idx->literal = Value::Int(Cur().int_value);
          idx->text = Cur().text;
          Next();
          a->children.push_back(std::move(e));
          a->children.push_back(std::move(idx));
          Finish(a.get(), begin);
          e = std::move(a);
        } else {
          return SyntaxError(Cur().line, "expected an attribute name after '.', got " + Describe());
        }
      } else if (IsOp("[")) {
        Next();
        MLARUN_ASSIGN_OR_RETURN(e, Subscript(std::move(e), begin, line));
      } else if (IsOp("(")) {
        MLARUN_ASSIGN_OR_RETURN(e, Call(std::move(e), begin, line));
      } else {
        return e;
      }
    }
  }

  StatusOr<std::unique_ptr<Expr>> Subscript(std::unique_ptr<Expr> e, size_t begin, int line) {
    std::unique_ptr<Expr> parts[3];
    int colons = 0;
    while (true) {
      if (IsOp(":")) {
        if (++colons > 2) return SyntaxError(Cur().line, "a slice has at most two ':'");
        Next();
        continue;
      }
      if (IsOp("]")) break;
      if (parts[colons]) return SyntaxError(Cur().line, "expected ']' or ':', got " + Describe());
      MLARUN_ASSIGN_OR_RETURN(parts[colons], Expression(true));
      if (colons == 0 && IsOp(",")) {
        return SyntaxError(Cur().line, "tuple subscripts (x[a, b]) are not supported");
      }
    }
    MLARUN_RETURN_IF_ERROR(ExpectOp("]"));
    if (colons == 0) {
      if (!parts[0]) return SyntaxError(line, "an empty subscript []");
      auto item = Make(ExprKind::kItem, begin, line);
      item->children.push_back(std::move(e));
      item->children.push_back(std::move(parts[0]));
      Finish(item.get(), begin);
      return item;
    }
    auto slice = Make(ExprKind::kSlice, begin, line);
    slice->children.push_back(std::move(e));
    for (auto& p : parts) slice->children.push_back(std::move(p));
    Finish(slice.get(), begin);
    return slice;
  }

  // `(args, name=value)` into e->children[1..] and e->kwargs.
  Status Args(Expr* e) {
    MLARUN_RETURN_IF_ERROR(ExpectOp("("));
    while (!IsOp(")")) {
      if (IsOp("*") || IsOp("**")) {
        return InvalidArgumentError("chat template line ", Cur().line,
                                    ": *args/**kwargs in a call are not supported by mlarun's chat template "
                                    "interpreter",
                                    kRenderYourselfHint);
      }
      if (Cur().type == TokType::kName && Peek().type == TokType::kOp && Peek().text == "=") {
        std::string key = Cur().text;
        Next();
        Next();
        std::unique_ptr<Expr> value;
        MLARUN_ASSIGN_OR_RETURN(value, Expression(true));
        e->kwargs.emplace_back(key, std::move(value));
      } else {
        if (!e->kwargs.empty()) return SyntaxError(Cur().line, "a positional argument after a keyword argument");
        std::unique_ptr<Expr> value;
        MLARUN_ASSIGN_OR_RETURN(value, Expression(true));
        e->children.push_back(std::move(value));
      }
      if (!IsOp(",")) break;
      Next();
    }
    return ExpectOp(")");
  }

  StatusOr<std::unique_ptr<Expr>> Call(std::unique_ptr<Expr> callee, size_t begin, int line) {
    auto c = Make(ExprKind::kCall, begin, line);
    c->children.push_back(std::move(callee));
    MLARUN_RETURN_IF_ERROR(Args(c.get()));
    Finish(c.get(), begin);
    return c;
  }

  StatusOr<std::unique_ptr<Expr>> Filter(std::unique_ptr<Expr> input, size_t begin) {
    int line = Cur().line;
    if (Cur().type != TokType::kName) return SyntaxError(line, "expected a filter name after '|', got " + Describe());
    std::string name = Cur().text;
    if (!IsKnownFilter(name)) {
      return InvalidArgumentError("chat template line ", line, ": the filter '", name,
                                  "' is not supported by mlarun's chat template interpreter", kRenderYourselfHint);
    }
    Next();
    auto f = Make(ExprKind::kFilter, begin, line);
    f->name = name;
    f->children.push_back(std::move(input));
    if (IsOp("(")) MLARUN_RETURN_IF_ERROR(Args(f.get()));
    Finish(f.get(), begin);
    return f;
  }

  StatusOr<std::unique_ptr<Expr>> FilterExpr(std::unique_ptr<Expr> e, size_t begin) {
    while (true) {
      if (IsOp("|")) {
        Next();
        MLARUN_ASSIGN_OR_RETURN(e, Filter(std::move(e), begin));
      } else if (IsName("is")) {
        Next();
        int line = Cur().line;
        auto t = Make(ExprKind::kTest, begin, line);
        if (IsName("not")) {
          t->negated = true;
          Next();
        }
        if (Cur().type != TokType::kName)
          return SyntaxError(line, "expected a test name after 'is', got " + Describe());
        t->name = Cur().text;
        if (!IsKnownTest(t->name)) {
          return InvalidArgumentError("chat template line ", line, ": the test '", t->name,
                                      "' is not supported by mlarun's chat template interpreter", kRenderYourselfHint);
        }
        Next();
        t->children.push_back(std::move(e));
        if (IsOp("(")) {
          MLARUN_RETURN_IF_ERROR(Args(t.get()));
        } else if ((Cur().type == TokType::kName || Cur().type == TokType::kString || Cur().type == TokType::kInt ||
                    Cur().type == TokType::kFloat || IsOp("(") || IsOp("[") || IsOp("{")) &&
                   !IsName("else") && !IsName("or") && !IsName("and")) {
          if (IsName("is")) return SyntaxError(Cur().line, "tests cannot be chained with 'is'");
          size_t arg_begin = Cur().begin;
          std::unique_ptr<Expr> arg;
          MLARUN_ASSIGN_OR_RETURN(arg, Primary());
          MLARUN_ASSIGN_OR_RETURN(arg, Postfix(std::move(arg), arg_begin));
          t->children.push_back(std::move(arg));
        }
        Finish(t.get(), begin);
        e = std::move(t);
      } else if (IsOp("(")) {
        MLARUN_ASSIGN_OR_RETURN(e, Call(std::move(e), begin, Cur().line));
      } else {
        return e;
      }
    }
  }

  const std::string& src_;
  std::vector<Segment> segs_;
  size_t seg_ = 0;
  const std::vector<Token>* toks_ = nullptr;
  size_t tok_ = 0;
  int loop_depth_ = 0;
  int block_depth_ = 0;
  int expr_depth_ = 0;
  int open_line_ = 1;
};

}  // namespace

StatusOr<NodeList> ParseTemplate(const std::string& source) {
  Lexer lexer(source);
  std::vector<Segment> segs;
  MLARUN_ASSIGN_OR_RETURN(segs, lexer.Run());
  Parser parser(lexer.source(), std::move(segs));
  return parser.Run();
}

}  // namespace mlarun::text::jinja
