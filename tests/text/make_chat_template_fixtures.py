#!/usr/bin/env python3
"""Renders chat templates with Python's jinja2, set up as transformers'
apply_chat_template sets it up, and writes what it printed (or the error it
raised) as fixtures for tests/text/chat_template_test.cc:

  fixtures/chat_template_cases.jsonl     the checkpoint templates in
                                         fixtures/chat_templates/*.jinja over
                                         many conversations
  fixtures/chat_template_snippets.jsonl  small templates, one feature each

Each line: {"name", "template" (a file name for cases, the source for
snippets), "context", and "output" or "error" (the exception's type and
message)}.

The C++ side gets the context as nlohmann::json, whose objects iterate in key
order, so every dict in a context is built with its keys sorted: both sides
then see the same order.

Usage: python3 tests/text/make_chat_template_fixtures.py   (needs jinja2)
"""

import json
import os
import sys
from datetime import datetime

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "fixtures")
TEMPLATES = os.path.join(FIXTURES, "chat_templates")

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"


def make_env():
    """The environment transformers renders chat templates in."""

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def sorted_keys(x):
    if isinstance(x, dict):
        return {k: sorted_keys(x[k]) for k in sorted(x)}
    if isinstance(x, list):
        return [sorted_keys(v) for v in x]
    return x


def render(env, source, context):
    context = sorted_keys(context)
    try:
        out = env.from_string(source).render(**context)
        return {"output": out}
    except Exception as e:  # noqa: BLE001 - the fixture records any failure
        return {"error": "%s: %s" % (type(e).__name__, e)}


# ---------------------------------------------------------------------------
# Conversations for the checkpoint templates.

def tool_call(name, args, call_id="call_0"):
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


CONVERSATIONS = {
    "single_user": [{"role": "user", "content": "Hello!"}],
    "system_user": [{"role": "system", "content": "You are a helpful assistant."},
                    {"role": "user", "content": "What is 2+2?"}],
    "multi_turn": [{"role": "user", "content": "Hi"},
                   {"role": "assistant", "content": "Hello! How can I help?"},
                   {"role": "user", "content": "Tell me a joke."},
                   {"role": "assistant", "content": "Why did the chicken cross the road?"},
                   {"role": "user", "content": "Why?"}],
    "system_multi_turn": [{"role": "system", "content": "Be terse."},
                          {"role": "user", "content": "a"},
                          {"role": "assistant", "content": "b"},
                          {"role": "user", "content": "c"}],
    "ends_with_assistant": [{"role": "user", "content": "Say hi"},
                            {"role": "assistant", "content": "hi"}],
    "empty_content": [{"role": "system", "content": ""},
                      {"role": "user", "content": ""},
                      {"role": "assistant", "content": ""},
                      {"role": "user", "content": "?"}],
    "unicode_newlines": [{"role": "system", "content": "Réponds en français.\nSois bref."},
                         {"role": "user", "content": "你好，世界！\n\n  indented\ttab 🙂"},
                         {"role": "assistant", "content": "Привет\r\nмир — ok «quotes» 'single' \"double\""},
                         {"role": "user", "content": "<｜User｜> looks like a token; \\n is not a newline"}],
    "two_systems": [{"role": "system", "content": "First system."},
                    {"role": "system", "content": "Second system."},
                    {"role": "user", "content": "Go"}],
    "whitespace_content": [{"role": "user", "content": "  padded  \n"},
                           {"role": "assistant", "content": "\n\nleading newlines"},
                           {"role": "user", "content": " "}],
    "tool_call": [{"role": "system", "content": "You can call tools."},
                  {"role": "user", "content": "Weather in Paris?"},
                  {"role": "assistant", "content": None,
                   "tool_calls": [tool_call("get_weather", {"city": "Paris", "unit": "celsius"})]},
                  {"role": "tool", "content": "{\"temperature\": 18, \"sky\": \"clear\"}"},
                  {"role": "assistant", "content": "It is 18°C and clear in Paris."},
                  {"role": "user", "content": "Thanks"}],
    "two_tool_calls": [{"role": "user", "content": "Weather in Paris and Rome?"},
                       {"role": "assistant", "content": None,
                        "tool_calls": [tool_call("get_weather", {"city": "Paris"}, "call_1"),
                                       tool_call("get_weather", {"city": "Rome"}, "call_2")]},
                       {"role": "tool", "content": "18"},
                       {"role": "tool", "content": "24"}],
    "tool_call_then_answer": [{"role": "user", "content": "What time is it?"},
                              {"role": "assistant", "content": None,
                               "tool_calls": [tool_call("now", {})]},
                              {"role": "tool", "content": "12:00"},
                              {"role": "assistant", "content": "It is noon."}],
    "tool_call_with_content": [{"role": "user", "content": "Search cats"},
                               {"role": "assistant", "content": "Let me search.",
                                "tool_calls": [tool_call("search", {"q": "cats", "n": 3})]},
                               {"role": "tool", "content": "[\"a\", \"b\"]"},
                               {"role": "user", "content": "ok"}],
    "reasoning": [{"role": "user", "content": "2+2?"},
                  {"role": "assistant", "content": "<think>\nSimple: 4.\n</think>\n\nIt is 4."},
                  {"role": "user", "content": "And 3+3?"}],
    "long_multi_turn": [m for i in range(12) for m in (
        {"role": "user", "content": "question %d" % i},
        {"role": "assistant", "content": "answer %d" % i})],
    "empty": [],
}

GEN_PROMPT_CHOICES = [None, False, True]


def checkpoint_cases(env):
    cases = []
    for fname in sorted(os.listdir(TEMPLATES)):
        if not fname.endswith(".jinja"):
            continue
        with open(os.path.join(TEMPLATES, fname), encoding="utf-8") as f:
            source = f.read()
        for conv_name, messages in CONVERSATIONS.items():
            for agp in GEN_PROMPT_CHOICES:
                context = {"messages": messages, "bos_token": BOS, "eos_token": EOS}
                if agp is not None:
                    context["add_generation_prompt"] = agp
                case = {"name": "%s/%s/agp=%s" % (fname[:-6], conv_name, agp), "template": fname,
                        "context": sorted_keys(context)}
                case.update(render(env, source, context))
                cases.append(case)
        # Tokens other than DeepSeek's, and no tokens at all (undefined).
        for ctx_name, context in (
                ("other_tokens", {"messages": CONVERSATIONS["system_multi_turn"], "bos_token": "<s>",
                                  "eos_token": "</s>", "add_generation_prompt": True}),
                ("no_tokens", {"messages": CONVERSATIONS["multi_turn"], "add_generation_prompt": True}),
                ("bad_role", {"messages": [{"role": "robot", "content": "beep"}], "bos_token": BOS,
                              "eos_token": EOS}),
                ("content_not_string", {"messages": [{"role": "user", "content": 42}], "bos_token": BOS,
                                        "eos_token": EOS}),
                ("content_list", {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                                  "bos_token": BOS, "eos_token": EOS}),
                ("content_missing", {"messages": [{"role": "user"}], "bos_token": BOS, "eos_token": EOS}),
        ):
            case = {"name": "%s/%s" % (fname[:-6], ctx_name), "template": fname, "context": sorted_keys(context)}
            case.update(render(env, source, context))
            cases.append(case)
    return cases


# ---------------------------------------------------------------------------
# Snippets: one feature each.

SNIPPETS = [
    # Printing Python values.
    ("print_bool_none", "{{ true }} {{ false }} {{ none }} {{ True }} {{ None }}", {}),
    ("print_numbers", "{{ 1 }} {{ 1.0 }} {{ 0.1 }} {{ 1e-5 }} {{ 1e16 }} {{ 123456789.125 }} {{ -0.0 }} {{ 2.50 }}", {}),
    ("print_division", "{{ 7 / 2 }} {{ 4 / 2 }} {{ 7 // 2 }} {{ -7 // 2 }} {{ 7 % 3 }} {{ -7 % 3 }} {{ 2 ** 10 }} {{ 2 ** -1 }}", {}),
    ("print_list_dict", "{{ [1, 'a', none, true, 1.5] }} {{ {'k': 'v', 'n': [1, 2]} }} {{ (1, 2) }} {{ (1,) }}", {}),
    ("print_context_values", "{{ x }}|{{ y }}|{{ z }}|{{ w }}", {"x": [1, "two", None], "y": {"a": True}, "z": 3.0, "w": None}),
    ("print_quotes_repr", "{{ [\"it's\", 'say \"hi\"', 'both \\' \"', 'tab\\there', 'new\\nline', 'back\\\\slash'] }}", {}),
    ("print_unicode_repr", "{{ ['héllo', '你好', '🙂'] }}", {}),
    ("undefined_prints_empty", "[{{ nothing }}][{{ nothing.attr is defined }}][{{ d.missing }}]", {"d": {}}),
    # Operators and precedence.
    ("precedence_arith", "{{ 1 + 2 * 3 }} {{ (1 + 2) * 3 }} {{ 2 ** 3 ** 2 }} {{ -2 ** 2 }} {{ 10 - 3 - 2 }} {{ 1 + 2 ~ 3 }}", {}),
    ("precedence_logic", "{{ not true or true }} {{ not (true or true) }} {{ true and false or true }} {{ 1 and 2 }} {{ 0 or 'x' }} {{ none or [] }}", {}),
    ("precedence_compare", "{{ 1 < 2 < 3 }} {{ 3 > 2 > 2 }} {{ 1 == 1.0 }} {{ 'a' != 'b' }} {{ 'ab' < 'b' }} {{ [1, 2] < [1, 3] }}", {}),
    ("in_not_in", "{{ 'a' in 'cat' }} {{ 'x' not in 'cat' }} {{ 2 in [1, 2] }} {{ 'k' in {'k': 1} }} {{ 'z' in d }} {{ 1 in [] }}", {"d": {"z": 0}}),
    ("concat_tilde", "{{ 'a' ~ 1 ~ none ~ true ~ 1.5 ~ undefined_var }}", {}),
    ("string_concat_and_repeat", "{{ 'ab' + 'cd' }} {{ 'ab' * 3 }} {{ 3 * 'x' }} {{ [1] + [2] }} {{ [0] * 3 }}", {}),
    ("conditional_expr", "{{ 'yes' if x else 'no' }} {{ 'a' if false }}|{{ 1 if 0 else 2 if 0 else 3 }}", {"x": 1}),
    ("not_is_defined", "{{ not x is defined }} {{ not y is defined }} {{ x is not defined }} {{ y is not none }}", {"y": 1}),
    ("truthiness", "{% for v in [0, 1, '', 'a', [], [0], {}, none, 0.0] %}{{ 'T' if v else 'F' }}{% endfor %}", {}),
    ("bool_arith", "{{ true + 1 }} {{ true == 1 }} {{ false == 0 }} {{ 1 == '1' }}", {}),
    ("unary", "{{ -x }} {{ +x }} {{ -(1 + 2) }} {{ -1|abs }}", {"x": 5}),
    # Tests.
    ("tests_types", "{{ 's' is string }} {{ 1 is number }} {{ 1 is integer }} {{ 1.0 is float }} {{ true is boolean }} "
                    "{{ true is integer }} {{ none is none }} {{ {} is mapping }} {{ [] is iterable }} {{ 'x' is sequence }} "
                    "{{ [] is mapping }} {{ 1 is string }}", {}),
    ("tests_values", "{{ true is true }} {{ 1 is true }} {{ false is false }} {{ 3 is odd }} {{ 4 is even }} "
                     "{{ 2 is equalto 2 }} {{ 2 is eq(3) }} {{ 9 is divisibleby 3 }} {{ 'a' is in 'abc' }} "
                     "{{ 'abc' is lower }} {{ 'ABC' is upper }} {{ 1 is gt 0 }} {{ 1 is ne 1 }}", {}),
    ("tests_defined", "{{ x is defined }} {{ x is undefined }} {{ y is defined }} {{ y.z is defined }} {{ y['z'] is undefined }}", {"y": {}}),
    # Filters.
    ("filter_trim_case", "[{{ '  a b  '|trim }}][{{ 'xxhixx'|trim('x') }}][{{ 'hello World'|upper }}][{{ 'HeLLo'|lower }}]"
                         "[{{ 'hello world'|capitalize }}][{{ 'hello big-world (x)'|title }}]", {}),
    ("filter_length", "{{ 'abc'|length }} {{ [1, 2]|length }} {{ {'a': 1}|count }} {{ '你好'|length }} {{ missing|length }}", {}),
    ("filter_default", "[{{ x|default('d') }}][{{ y|default('d') }}][{{ ''|default('d') }}][{{ ''|default('d', true) }}]"
                       "[{{ none|d('n') }}][{{ none|d('n', boolean=true) }}][{{ x|default }}]", {"y": "set"}),
    ("filter_join", "{{ [1, 2, 3]|join(', ') }} {{ ['a', 'b']|join }} {{ users|join(', ', attribute='name') }} {{ 'abc'|join('-') }}",
     {"users": [{"name": "ann"}, {"name": "bob"}]}),
    ("filter_replace", "{{ 'aaa'|replace('a', 'b') }} {{ 'aaa'|replace('a', 'b', 2) }} {{ 'abc'|replace('', '-') }}", {}),
    ("filter_string_int_float", "{{ 1|string + 'x' }} {{ '42'|int + 1 }} {{ '4.7'|int }} {{ 'x'|int }} {{ 'x'|int(7) }} "
                                "{{ '2.5'|float }} {{ 3|float }} {{ 'nope'|float }} {{ 3.9|int }} {{ true|int }}", {}),
    ("filter_first_last_list", "{{ [1, 2, 3]|first }} {{ [1, 2, 3]|last }} {{ 'abc'|first }} {{ 'abc'|list }} {{ {'a': 1, 'b': 2}|list }}", {}),
    ("filter_items", "{% for k, v in d|items %}{{ k }}={{ v }};{% endfor %}", {"d": {"a": 1, "b": [2]}}),
    ("filter_abs_round", "{{ -3|abs }} {{ -2.5|abs }} {{ 2.5|round }} {{ 3.5|round }} {{ 2.567|round(2) }} {{ 2.1|round(0, 'ceil') }} "
                         "{{ 2.9|round(method='floor') }} {{ 7|round }}", {}),
    ("filter_reverse_sort_unique", "{{ [3, 1, 2]|sort }} {{ [3, 1, 2]|sort(reverse=true) }} {{ 'abc'|reverse }} {{ [1, 2]|reverse|list }} "
                                   "{{ ['b', 'A', 'a', 'B']|unique|list }} {{ ['b', 'A', 'c']|sort }} {{ ['b', 'A', 'c']|sort(case_sensitive=true) }}", {}),
    ("filter_sort_attribute", "{{ users|sort(attribute='age')|map(attribute='name')|join(',') }}",
     {"users": [{"name": "a", "age": 30}, {"name": "b", "age": 20}, {"name": "c", "age": 25}]}),
    ("filter_selectattr", "{{ msgs|selectattr('role', 'equalto', 'user')|map(attribute='content')|join('|') }} "
                          "{{ msgs|rejectattr('role', 'eq', 'user')|list|length }} {{ msgs|selectattr('flag')|list|length }} "
                          "{{ [1, 2, 3, 4]|select('odd')|list }} {{ [0, 1, '', 'a']|reject|list }}",
     {"msgs": [{"role": "user", "content": "u1", "flag": True}, {"role": "assistant", "content": "a1"},
               {"role": "user", "content": "u2", "flag": False}]}),
    ("filter_map", "{{ ['a', 'b']|map('upper')|join }} {{ [1, 2]|map('string')|join('+') }} {{ ds|map(attribute='x', default='-')|join }}",
     {"ds": [{"x": "1"}, {}, {"x": "3"}]}),
    ("filter_tojson", "{{ d|tojson }}\n{{ d|tojson(indent=2) }}\n{{ 'é\"\\n'|tojson }} {{ [1.0, 2, none, true]|tojson }} {{ {}|tojson }} {{ []|tojson(indent=4) }}",
     {"d": {"a": [1, {"b": None, "c": "x\ty"}], "e": 1.5, "f": "日本", "g": {}}}),
    ("filter_tojson_tools", "{% for t in tools %}{{ t|tojson }}\n{% endfor %}",
     {"tools": [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {
         "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}]}),
    ("filter_indent", "{{ 'a\nb\n\nc'|indent }}|{{ 'a\nb'|indent(2, true) }}|{{ 'a\n\nb'|indent(2, blank=true) }}|{{ 'x\ny'|indent('> ') }}", {}),
    ("filter_min_max_sum", "{{ [3, 1, 2]|min }} {{ [3, 1, 2]|max }} {{ [1, 2, 3]|sum }} {{ [1.5, 2]|sum }} {{ ds|sum(attribute='n') }}",
     {"ds": [{"n": 1}, {"n": 5}]}),
    ("filter_chain_and_args", "{{ '  Hello  '|trim|lower|replace('l', 'L')|length }} {{ 'abc'|upper|list|join('.') }}", {}),
    ("filter_block", "{% filter upper %}shout {{ x }}{% endfilter %}", {"x": "loud"}),
    # String methods.
    ("str_split", "{{ 'a b  c'.split() }} {{ 'a,b,,c'.split(',') }} {{ 'a,b,c'.split(',', 1) }} {{ '  x  y '.split(None, 1) }} "
                  "{{ 'a,b,c'.rsplit(',', 1) }} {{ ''.split() }} {{ ''.split(',') }}", {}),
    ("str_strip", "[{{ '  x  '.strip() }}][{{ '  x  '.lstrip() }}][{{ '  x  '.rstrip() }}][{{ 'xxaxx'.strip('x') }}][{{ '\n\tx\n'.strip() }}]"
                  "[{{ 'abcba'.lstrip('ab') }}][{{ 'abcba'.rstrip('ab') }}]", {}),
    ("str_predicates", "{{ 'hello'.startswith('he') }} {{ 'hello'.endswith('lo') }} {{ 'hello'.startswith(('x', 'h')) }} "
                       "{{ 'hello'.endswith('x') }} {{ '123'.isdigit() }} {{ 'abc'.isalpha() }}", {}),
    ("str_methods", "{{ 'a-b-c'.replace('-', '+') }} {{ 'a-b-c'.replace('-', '', 1) }} {{ 'Hi'.upper() }} {{ 'Hi'.lower() }} "
                    "{{ 'hello world'.title() }} {{ 'hello World'.capitalize() }} {{ 'banana'.find('an') }} {{ 'banana'.rfind('an') }} "
                    "{{ 'banana'.find('x') }} {{ 'banana'.count('a') }} {{ '你好你'.find('你', 1) }}", {}),
    ("str_format_join", "{{ '{} and {}'.format('a', 'b') }} {{ '{1}{0}'.format('a', 'b') }} {{ '{x}!'.format(x=1) }} {{ ', '.join(['a', 'b']) }}", {}),
    ("str_index_slice", "{{ s[0] }} {{ s[-1] }} {{ s[1:3] }} {{ s[::-1] }} {{ s[:2] }} {{ s[2:] }} {{ s[::2] }} {{ s[-3:-1] }} {{ s[10:] }}|{{ s[99] }}",
     {"s": "héllo"}),
    ("list_index_slice", "{{ xs[0] }} {{ xs[-1] }} {{ xs[1:] }} {{ xs[:-1] }} {{ xs[::-1] }} {{ xs[5] is defined }} {{ xs.1 }}", {"xs": [1, 2, 3, 4]}),
    ("content_split_think", "{{ c.split('</think>')[-1].strip() }}|{{ c.split('</think>')[0] }}", {"c": "<think>reasoning</think>\n\nanswer  "}),
    # Dict methods.
    ("dict_methods", "{{ d.get('a') }} {{ d.get('z') }} {{ d.get('z', 'dflt') }} {{ d.keys()|list }} {{ d.values()|list }} "
                     "{% for k, v in d.items() %}{{ k }}:{{ v }} {% endfor %}{{ d['a'] }} {{ d.a }}", {"d": {"a": 1, "b": "two"}}),
    ("dict_literal_access", "{% set m = {'role': 'user', 'content': 'x'} %}{{ m.role }}{{ m['content'] }}{{ m|length }}", {}),
    # Loops.
    ("loop_vars", "{% for x in xs %}{{ loop.index }}{{ loop.index0 }}{{ loop.first }}{{ loop.last }}{{ loop.length }}{{ loop.revindex }}{{ loop.revindex0 }};{% endfor %}",
     {"xs": ["a", "b", "c"]}),
    ("loop_prev_next", "{% for x in xs %}[{{ loop.previtem }}|{{ x }}|{{ loop.nextitem }}]{% endfor %}", {"xs": [1, 2, 3]}),
    ("loop_filter_if", "{% for x in xs if x % 2 == 0 %}{{ x }}{{ loop.index }}{{ loop.last }} {% endfor %}", {"xs": [1, 2, 3, 4, 5, 6]}),
    ("loop_else", "{% for x in [] %}{{ x }}{% else %}empty{% endfor %}|{% for x in [1] if x > 5 %}{{ x }}{% else %}none{% endfor %}", {}),
    ("loop_break_continue", "{% for x in range(10) %}{% if x == 2 %}{% continue %}{% endif %}{% if x == 5 %}{% break %}{% endif %}{{ x }}{% endfor %}", {}),
    ("loop_nested", "{% for a in [1, 2] %}{% for b in ['x', 'y'] %}{{ a }}{{ b }}{{ loop.index }}{% endfor %}{{ loop.index }} {% endfor %}", {}),
    ("loop_dict", "{% for k in d %}{{ k }}{% endfor %} {% for k, v in d.items() %}{{ k }}{{ v }}{% endfor %}", {"d": {"x": 1, "y": 2}}),
    ("loop_string", "{% for c in 'héy' %}[{{ c }}]{% endfor %}", {}),
    ("loop_cycle", "{% for x in range(5) %}{{ loop.cycle('a', 'b') }}{% endfor %}", {}),
    ("loop_range", "{{ range(3)|list }} {{ range(1, 4)|list }} {{ range(10, 0, -3)|list }} {{ range(0)|list }}", {}),
    ("loop_scope", "{% set x = 'outer' %}{% for i in [1, 2] %}{% set x = 'inner' ~ i %}{{ x }} {% endfor %}{{ x }}", {}),
    ("loop_over_undefined", "[{% for x in nothing %}{{ x }}{% endfor %}]", {}),
    # Assignment and namespaces.
    ("set_basic", "{% set a = 1 %}{% set b, c = [2, 3] %}{% set t = 4, 5 %}{{ a }}{{ b }}{{ c }}{{ t }}", {}),
    ("set_in_if_visible", "{% if true %}{% set x = 'set in if' %}{% endif %}{{ x }}", {}),
    ("set_block", "{% set greeting %}Hello {{ name }}!{% endset %}[{{ greeting }}] {{ greeting|length }}", {"name": "Ann"}),
    ("namespace", "{% set ns = namespace(count=0, found=false, last='') %}{% for x in xs %}{% set ns.count = ns.count + 1 %}"
                  "{% if x == 'b' %}{% set ns.found = true %}{% endif %}{% set ns.last = x %}{% endfor %}{{ ns.count }} {{ ns.found }} {{ ns.last }}",
     {"xs": ["a", "b", "c"]}),
    ("namespace_missing_attr", "{% set ns = namespace(a=1) %}[{{ ns.b }}][{{ ns.b is defined }}]", {}),
    ("with_block", "{% with a = 1, b = 'x' %}{{ a }}{{ b }}{% endwith %}[{{ a }}]", {}),
    # Macros.
    ("macro_basic", "{% macro greet(name, punct='!') %}Hi {{ name }}{{ punct }}{% endmacro %}{{ greet('Ann') }} {{ greet('Bob', '?') }} {{ greet(punct='.', name='Cy') }}", {}),
    ("macro_recursive_render", "{% macro render(v) %}{% if v is mapping %}{% for k, x in v.items() %}{{ k }}({{ render(x) }}){% endfor %}"
                               "{% elif v is string %}'{{ v }}'{% else %}{{ v }}{% endif %}{% endmacro %}{{ render(d) }}",
     {"d": {"a": {"b": "c", "d": 1}, "e": [1, 2]}}),
    ("macro_outer_scope", "{% set prefix = '>> ' %}{% macro p(x) %}{{ prefix }}{{ x }}{% endmacro %}{{ p('a') }}", {}),
    # Whitespace control.
    ("ws_trim_blocks", "{% if true %}\nline1\n{% endif %}\nline2\n", {}),
    ("ws_lstrip_blocks", "    {% if true %}\n    indented\n    {% endif %}\nend", {}),
    ("ws_minus", "a   {%- if true -%}   b   {%- endif -%}   c\n  {{- ' d ' -}}  \n e", {}),
    ("ws_plus", "  {%+ if true %}x{% endif +%}\ny", {}),
    ("ws_var_not_trimmed", "{{ 'a' }}\n{{ 'b' }}\n", {}),
    ("ws_comment", "a\n{# a comment #}\nb {#- trimmed -#} c\n    {# indented comment #}\nd", {}),
    ("ws_mixed_loop", "{% for m in ms %}\n  {{ m }}\n{% endfor %}\n", {"ms": [1, 2]}),
    ("ws_trailing_newline_dropped", "text\n", {}),
    ("ws_crlf", "a\r\n{% if true %}\r\nb\r\n{% endif %}\r\nc", {}),
    ("raw_block", "{% raw %}{{ not rendered }} {% if %}{% endraw %}|{%- raw -%}  x  {%- endraw -%}  |", {}),
    ("string_escapes", "{{ 'a\\tb\\nc' }}|{{ \"q'\" }}|{{ 'u\\u00e9' }}|{{ 'x\\x41' }}|{{ 'back\\\\' }}|{{ 'un\\known' }}", {}),
    ("adjacent_strings", "{{ 'a' 'b' \"c\" }}", {}),
    ("integer_underscore", "{{ 1_000 + 1 }} {{ 1.5e3 }} {{ 2E-2 }}", {}),
    # Errors.
    ("raise_exception", "{% if x %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}ok", {"x": True}),
    ("raise_exception_not_taken", "{% if x %}{{ raise_exception('no') }}{% endif %}ok", {"x": False}),
    ("error_add_str_int", "{{ 'a' + 1 }}", {}),
    ("error_undefined_attr", "{{ nothing.attr }}", {}),
    ("error_undefined_add", "{{ nothing + 'x' }}", {}),
    ("error_none_iter", "{% for x in n %}{% endfor %}", {"n": None}),
    ("error_call_non_callable", "{{ s() }}", {"s": "str"}),
    ("error_compare_types", "{{ 1 < 'a' }}", {}),
    ("error_div_zero", "{{ 1 / 0 }}", {}),
    ("error_set_attr_non_namespace", "{% set d = {} %}{% set d.x = 1 %}", {}),
    ("error_tojson_undefined", "{{ nothing|tojson }}", {}),
    ("none_subscript_is_undefined", "[{{ n['x'] }}][{{ n.x }}][{{ n['x'] is defined }}]", {"n": None}),
]

# Edge cases: scoping, whitespace, printing and number formatting corners.
EDGE_SNIPPETS = [
    ('edge_dict_views', "{{ d.items() }} {{ d.keys() }} {{ d.values() }} {{ d.items()|list }} {{ d|items|list }}", {'d': {'a': 1, 'b': [2]}}),
    ('edge_01', '{{ d.items()|list }}', {'d': {'a': 1}}),
    ('edge_02', '{% for i in [1,2] %}{% if i == 2 %}{{ x }}{% endif %}{% set x = i %}{% endfor %}', {}),
    ('edge_03', '{% set x = 5 %}{% for i in [1,2] %}{{ x }}{% set x = i %}{% endfor %}{{ x }}', {}),
    ('edge_04', '  {% if true %}x{% endif %}  \n  {%- if true %}y{% endif %}', {}),
    ('edge_05', 'a\n  {# c #}  \nb', {}),
    ('edge_06', 'a {% if true %} b {% endif %} c', {}),
    ('edge_07', '{% for x in xs %}{{ loop.previtem }}{% endfor %}', {'xs': [1, 2]}),
    ('edge_08', "{{ 'abc'[1:] ~ 'x' * 2 }}", {}),
    ('edge_09', '{{ [1,2,3][::2] }} {{ (1,2,3)[1:] }}', {}),
    ('edge_10', '{{ none is none }} {{ x is none }}', {}),
    ('edge_11', "{{ '%s' % 'a' }}", {}),
    ('edge_12', '{{ 1 if x is defined else 2 }}', {}),
    ('edge_13', '{{ 3 // 0.5 }} {{ 7.5 % 2 }} {{ -7.5 // 2 }}', {}),
    ('edge_14', '{{ 0.1 + 0.2 }} {{ 1/3 }} {{ 2.0 * 3 }} {{ 1e300 * 1e10 }}', {}),
    ('edge_15', "{{ 'A' < 'a' }} {{ 'é' > 'z' }}", {}),
    ('edge_16', '{{ x|string }}|{{ x|trim }}|{{ x|upper }}', {}),
    ('edge_17', "{{ [none, true]|tojson }} {{ 'a\u2028b'|tojson }}", {}),
    ('edge_18', "{{ {'b': 1, 'a': 2}|tojson(sort_keys=true) }}", {}),
    ('edge_19', '{{ d|tojson(indent=2) }}', {'d': {'a': [1, [2, {}]], 'b': []}}),
    ('edge_20', '{% macro m(a, b) %}{{ a }}-{{ b }}{% endmacro %}{{ m(1) }}|', {}),
    ('edge_21', '{% macro m() %}x{% endmacro %}{{ m|string }}', {}),
    ('edge_22', "{{ 'a,b'.split(',')|join('|') }} {{ 'ab'|list|length }}", {}),
    ('edge_23', '{% for a, b in [[1, 2], [3, 4]] %}{{ a }}{{ b }}{% endfor %}', {}),
    ('edge_24', '{% for a, b in [[1, 2, 3]] %}{{ a }}{% endfor %}', {}),
    ('edge_25', "{{ messages[-1]['content'] }}", {'messages': [{'content': 'a'}, {'content': 'b'}]}),
    ('edge_26', "{{ messages|selectattr('role','equalto','system')|list|length > 0 }}", {'messages': [{'role': 'system'}]}),
    ('edge_27', "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% else %}{% set loop_messages = messages %}{% endif %}{{ loop_messages|length }}", {'messages': [{'role': 'system'}, {'role': 'user'}]}),
    ('edge_28', '{{ x.y.z }}', {'x': {}}),
    ('edge_29', '{{ x.y is defined and x.y.z }}', {'x': {}}),
    ('edge_30', "{{ 'abc' is string and 'abc' is not mapping }}", {}),
    ('edge_31', '{{ true and none }}|{{ false or undefined_thing }}|', {}),
    ('edge_32', '{{ 1 == 1 == 1 }} {{ 1 != 2 != 1 }}', {}),
    ('edge_33', "{{ 'x' ~ [1] ~ {'a': none} }}", {}),
    ('edge_34', "{{ [1, 'a'] == [1, 'a'] }} {{ {'a': 1} == {'a': 1} }} {{ (1,) == [1] }}", {}),
    ('edge_35', '{% set a = [1] %}{% set b = a + [2] %}{{ a }}{{ b }}', {}),
    ('edge_36', "{{ 'hello'|replace('l', '') }} {{ 'Hello World'|lower|title }}", {}),
    ('edge_37', "{{ '  x  '|trim|length }} {{ 'abc'|center(9) if false else 'n' }}", {}),
    ('edge_38', "{{ [3,1,2]|sort|first }} {{ ['x']|last }} {{ []|first }}|{{ []|last is defined }}", {}),
    ('edge_39', "{{ 'a' in ['a'] and 'b' not in ['a'] }}", {}),
    ('edge_40', '{%- for m in ms -%}\n  {{ m }}\n{%- endfor -%}\n', {'ms': [1, 2]}),
    ('edge_41', '{% for m in ms %}\n    {% if m %}\n        {{ m }}\n    {% endif %}\n{% endfor %}', {'ms': [1, 0, 2]}),
    ('edge_42', "{{- 'a' -}}\n\n{{- 'b' }}", {}),
    ('edge_43', 'x {%+ if true %}y{% endif %}', {}),
    ('edge_44', '{% if true %}a{% elif false %}b{% else %}c{% endif %}{% if false %}a{% elif true %}b{% endif %}', {}),
    ('edge_45', "{{ 1.5|int }} {{ -1.5|int }} {{ '0x1A'|int(0, 16) }} {{ ' 12 '|int }} {{ '1e3'|int }} {{ '1e3'|float }}", {}),
    ('edge_46', '{{ 2.5|round }} {{ -2.5|round }} {{ 0.125|round(2) }} {{ 1.005|round(2) }}', {}),
    ('edge_47', '{{ 1.0e16 }} {{ 123456789012345680.0 }} {{ 1e-4 }} {{ 0.0001234 }} {{ 5e-324 }}', {}),
    ('edge_48', '{{ x }}', {'x': 1e+100}),
    ('edge_49', '{{ x|tojson }}', {'x': [1.0, 0.5, 100.0, 1e+20]}),
    ('edge_50', '{{ ns }}', {}),
    ('edge_51', '{% set ns = namespace(a=1) %}{{ ns.a }}{% set ns.b = 2 %}{{ ns.b }}', {}),
    ('edge_52', '{{ namespace(a=1).a }}', {}),
    ('edge_53', '{% set ns = namespace() %}{% set ns.items = [1] %}{{ ns.items }}', {}),
    ('edge_54', "{{ dict(a=1, b='x') }}", {}),
    ('edge_55', "{{ 'Hi {name}'.format(name='Bo') }}", {}),
    ('edge_56', "{{ 'a\tb'.split() }} {{ 'a  b'.split(' ') }}", {}),
    ('edge_57', "{{ 'x'.startswith('') }} {{ ''.endswith('a') }}", {}),
    ('edge_58', "{{ 'ABC'.lower().upper().lower() }}", {}),
    ('edge_59', "{{ 'hello'[1] }}{{ 'hello'[-1] }}", {}),
    ('edge_60', "{{ [1,2,3]|map('string')|list }}", {}),
    ('edge_61', "{{ [{'a': 1}, {'a': 2}]|map(attribute='a')|sum }}", {}),
    ('edge_62', '{{ tools|length }}|{{ tools is defined }}|{{ tools is none }}', {'tools': None}),
    ('edge_63', '{% if tools %}T{% endif %}{% if tools is not none %}N{% endif %}', {}),
    ('edge_64', '{{ messages[0].content.strip() }}', {'messages': [{'content': '  a '}]}),
    ('edge_65', "{%- set x = 'a' -%}\n{{ x }}", {}),
    ('edge_66', '{% raw -%}  a  {%- endraw %}', {}),
    ('edge_67', '{{ "it\'s" }} {{ \'say "x"\' }}', {}),
    ('edge_68', "{{ 'a' if true else 'b' ~ 'c' }}", {}),
    ('edge_69', "{{ [1, 2][5] }}|{{ 'x'[3] }}|", {}),
    ('edge_70', '{{ loop }}', {}),
    ('edge_71', '{% for x in [1] %}{{ loop.length + loop.index }}{% endfor %}', {}),
    ('edge_72', '{% for x in range(3) %}{{ x }}{% if not loop.last %}, {% endif %}{% endfor %}', {}),
    ('edge_73', "{{ (1 + 2) ~ '' }} {{ (1, 2)|length }}", {}),
    ('edge_74', "{% set t = (1, 'a') %}{{ t }} {{ t[1] }}", {}),
    ('edge_75', "{{ 'a' 'b' ~ 'c' }}", {}),
    ('edge_76', "{{ x['a-b'] }}", {'x': {'a-b': 1}}),
    ('edge_77', '{{ 5 is divisibleby(2) }} {{ 4 is divisibleby 2 }}', {}),
    ('edge_78', "{{ 'abc' | length }} {{ 'abc'|upper|lower }}", {}),
    ('edge_79', "{{ [] is sequence }} {{ 1 is iterable }} {{ 'a' is iterable }} {{ none is mapping }}", {}),
    ('edge_80', "{{ 'x'|default('y', true) }} {{ 0|default('y', true) }} {{ false|default('y') }}", {}),
    ('edge_81', '{{ \'a-b_c d\'|title }} {{ "o\'neil"|title }} {{ \'x1y\'|title }}', {}),
    ('edge_82', '{{ \'Hello\'.title() }} {{ "o\'neil".title() }} {{ \'x1y\'.title() }}', {}),
    ('edge_83', "{{ 'abc'.capitalize() }} {{ 'ABC'|capitalize }}", {}),
    ('edge_84', "{{ [1,[2,[3]]] }} {{ {'a': {'b': [1, 'x']}} }}", {}),
    ('edge_85', '{{ x }}', {'x': {'k': [True, None, 1.5, 's']}}),
    ('edge_86', "{{ '\\\\' }} {{ ['\\\\'] }} {{ ['\\x00\\x7f'] }}", {}),
    ('edge_87', "{{ ['é\\u00a0'] }}", {}),
    ('edge_scope_01', '{% set x = 1 %}{% macro m() %}{{ x }}{% endmacro %}{% set x = 2 %}{{ m() }}', {}),
    ('edge_scope_02', '{% for x in [1] %}{% endfor %}[{{ x }}]', {}),
    ('edge_scope_03', '[{{ loop }}][{{ loop.index }}]', {}),
    ('edge_scope_04', '{% for a in [1,2] %}{% set outer = loop %}{% for b in [1] %}{{ outer.index }}{% endfor %}{% endfor %}', {}),
    ('edge_scope_05', '{%- if true %}x{% endif -%}   ', {}),
    ('edge_scope_06', '{{ "<a>"|e }}{{ "x"|escape }}', {}),
    ('edge_scope_07', '{{ "a" in nothing }}', {}),
    ('edge_scope_08', '{% for m in messages %}{% if loop.first and m.role != "system" %}S{% endif %}{{ m.role }}{% endfor %}', {'messages': [{'role': 'user'}, {'role': 'assistant'}]}),
    ('edge_scope_09', '{{ messages[0] }}', {'messages': [{'role': 'user', 'content': 'hi'}]}),
    ('edge_scope_10', '{% for m in messages if m.role == "user" %}{{ loop.index }}{{ m.content }}{% endfor %}', {'messages': [{'role': 'user', 'content': 'a'}, {'role': 'system', 'content': 'b'}, {'role': 'user', 'content': 'c'}]}),
    ('edge_scope_11', '{% set a = {"x": 1} %}{{ a.x }}{{ a["x"] }}{{ a.get("x") }}{{ a.y|default(5) }}', {}),
    ('edge_scope_12', '{{ xs|selectattr("a", "defined")|list|length }}', {'xs': [{'a': 1}, {}]}),
    ('edge_scope_13', '{{ xs|map(attribute="a.b")|list }}', {'xs': [{'a': {'b': 1}}, {'a': {'b': 2}}]}),
    ('edge_scope_14', '{{ xs|sort(attribute="n", reverse=true)|map(attribute="n")|join }}', {'xs': [{'n': 1}, {'n': 3}, {'n': 2}]}),
    ('edge_scope_15', '{{ "%d items" % 3 }} {{ "%s-%s" % (1, "a") }} {{ "%.2f" % 3.14159 }} {{ "%5s|" % "ab" }} {{ "%%" % () }}', {}),
    ('edge_scope_16', '{{ "abc"|center(7) }}|{{ "ab"|center(5) }}|', {}),
    ('edge_scope_17', '{% set x %}  a\n  b {% endset %}[{{ x }}]', {}),
    ('edge_scope_18', '{% with %}{% set q = 1 %}{{ q }}{% endwith %}[{{ q }}]', {}),
    ('edge_scope_19', '{%- for x in [1, 2] -%}\n  {{ x }}\n{%- endfor %}', {}),
    ('edge_scope_20', '{% for x in [1] %}{{ x }}{% else %}E{% endfor %}', {}),
    ('edge_scope_21', '{{ {"a": 1}.items()|list }}', {}),
    ('edge_case_mapping_01', '{{ w.upper() }}|{{ w.lower() }}|{{ w.title() }}|{{ w.capitalize() }}|{{ w|upper }}|{{ w|lower }}|{{ w|title }}|{{ w|capitalize }}|{{ w.islower() }}|{{ w.isupper() }}', {'w': 'héllo wörld'}),
    ('edge_case_mapping_02', '{{ w.upper() }}|{{ w.lower() }}|{{ w.title() }}|{{ w.capitalize() }}|{{ w|upper }}|{{ w|lower }}|{{ w|title }}|{{ w|capitalize }}|{{ w.islower() }}|{{ w.isupper() }}', {'w': 'ÀÉÎÕÜ àéîõü'}),
    ('edge_case_mapping_03', '{{ w.upper() }}|{{ w.lower() }}|{{ w.title() }}|{{ w.capitalize() }}|{{ w|upper }}|{{ w|lower }}|{{ w|title }}|{{ w|capitalize }}|{{ w.islower() }}|{{ w.isupper() }}', {'w': 'straße'}),
    ('edge_case_mapping_04', '{{ w.upper() }}|{{ w.lower() }}|{{ w.title() }}|{{ w.capitalize() }}|{{ w|upper }}|{{ w|lower }}|{{ w|title }}|{{ w|capitalize }}|{{ w.islower() }}|{{ w.isupper() }}', {'w': 'Ÿÿ'}),
    ('edge_case_mapping_05', '{{ w.upper() }}|{{ w.lower() }}|{{ w.title() }}|{{ w.capitalize() }}|{{ w|upper }}|{{ w|lower }}|{{ w|title }}|{{ w|capitalize }}|{{ w.islower() }}|{{ w.isupper() }}', {'w': 'ĀāĂă Ĺĺ Źź ı ſ'}),
    ('edge_case_mapping_06', '{{ w.upper() }}|{{ w.lower() }}|{{ w.title() }}|{{ w.capitalize() }}|{{ w|upper }}|{{ w|lower }}|{{ w|title }}|{{ w|capitalize }}|{{ w.islower() }}|{{ w.isupper() }}', {'w': 'Ελληνικά ΆΈΉΊΌΎΏ άέήίόύώ'}),
    ('edge_case_mapping_07', '{{ w.upper() }}|{{ w.lower() }}|{{ w.title() }}|{{ w.capitalize() }}|{{ w|upper }}|{{ w|lower }}|{{ w|title }}|{{ w|capitalize }}|{{ w.islower() }}|{{ w.isupper() }}', {'w': 'Привет Мир ЁЖ ёж'}),
    ('edge_case_mapping_08', '{{ w.upper() }}|{{ w.lower() }}|{{ w.title() }}|{{ w.capitalize() }}|{{ w|upper }}|{{ w|lower }}|{{ w|title }}|{{ w|capitalize }}|{{ w.islower() }}|{{ w.isupper() }}', {'w': 'µ'}),
    ('edge_case_mapping_09', '{{ w.upper() }}|{{ w.lower() }}|{{ w.title() }}|{{ w.capitalize() }}|{{ w|upper }}|{{ w|lower }}|{{ w|title }}|{{ w|capitalize }}|{{ w.islower() }}|{{ w.isupper() }}', {'w': 'x1y z2Z'}),
    ('edge_case_mapping_10', '{{ w.upper() }}|{{ w.lower() }}|{{ w.title() }}|{{ w.capitalize() }}|{{ w|upper }}|{{ w|lower }}|{{ w|title }}|{{ w|capitalize }}|{{ w.islower() }}|{{ w.isupper() }}', {'w': '你好a世界b'}),
    ('edge_case_mapping_11', '{{ w.upper() }}|{{ w.lower() }}|{{ w.title() }}|{{ w.capitalize() }}|{{ w|upper }}|{{ w|lower }}|{{ w|title }}|{{ w|capitalize }}|{{ w.islower() }}|{{ w.isupper() }}', {'w': "o'neil mc-donald (bob) [x] <y>"}),
    ('edge_set_block_filter', "{% set x | upper %}ab{{ 1 }}{% endset %}{{ x }}|{% set y | trim | replace('a', 'b') %}  aa  {% endset %}[{{ y }}]", {}),
]


def snippet_cases(env):
    cases = []
    for name, source, context in SNIPPETS + EDGE_SNIPPETS:
        case = {"name": name, "template": source, "context": sorted_keys(context)}
        case.update(render(env, source, context))
        cases.append(case)
    return cases


def write_jsonl(path, cases):
    with open(path, "w", encoding="utf-8") as f:
        for c in cases:
            f.write(json.dumps(c, ensure_ascii=False) + "\n")
    print("wrote %d cases to %s" % (len(cases), os.path.relpath(path)), file=sys.stderr)


def main():
    env = make_env()
    write_jsonl(os.path.join(FIXTURES, "chat_template_cases.jsonl"), checkpoint_cases(env))
    write_jsonl(os.path.join(FIXTURES, "chat_template_snippets.jsonl"), snippet_cases(env))


if __name__ == "__main__":
    main()
