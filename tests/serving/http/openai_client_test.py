"""The coordinator's HTTP API through the official openai client (run by
openai_client_test.sh, which starts the deployments).

  openai_client_test.py BASE_URL TOKENIZER_JSON GENERATE_HELPER SCRATCH_DIR \
      R1_BASE_URL R1_SCRIPT_TEXT JSON_BASE_URL JSON_SCRIPT_TEXT

GENERATE_HELPER runs `mlarun generate --prompts FILE --json` on the tiny
model: the reference tokens for a prompt and seed. R1_BASE_URL is a
coordinator with --reasoning-parser deepseek_r1 whose simulated group answers
every request with the tokens of R1_SCRIPT_TEXT; JSON_BASE_URL a coordinator
whose simulated group answers with JSON_SCRIPT_TEXT.
"""
import json
import os
import re
import subprocess
import sys
import typing

import jinja2
import jinja2.ext
import jinja2.sandbox
import openai
import pydantic
from tokenizers import Tokenizer

base_url, tokenizer_json, generate, scratch, r1_base_url, r1_script_text, json_base_url, json_script_text = \
    sys.argv[1:9]
client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60)
tok = Tokenizer.from_file(tokenizer_json)
MODEL = "tiny"


def reference(requests):
    """mlarun generate's tokens and finish reasons for these requests."""
    path = os.path.join(scratch, "reference.jsonl")
    with open(path, "w") as f:
        for r in requests:
            f.write(json.dumps(r) + "\n")
    out = subprocess.run([generate, path], check=True, capture_output=True, text=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def render_chat(messages):
    """The chat template rendered as transformers' apply_chat_template does."""
    with open(os.path.join(os.path.dirname(tokenizer_json), "tokenizer_config.json")) as f:
        cfg = json.load(f)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def token(t):
        return t["content"] if isinstance(t, dict) else (t or "")

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env.from_string(cfg["chat_template"]).render(
        messages=messages, add_generation_prompt=True, bos_token=token(cfg.get("bos_token")),
        eos_token=token(cfg.get("eos_token")))


def decode(ids):
    return tok.decode(ids, skip_special_tokens=True)


def streamed_text(stream, chat=False):
    texts, finish, usage, roles = {}, {}, None, set()
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if chat:
                if c.delta.role is not None:
                    assert c.delta.role == "assistant", c
                    roles.add(c.index)
                else:
                    assert c.index in roles, "a chat delta before its role"
                piece = c.delta.content or ""
            else:
                piece = c.text
            texts[c.index] = texts.get(c.index, "") + piece
            if c.finish_reason is not None:
                finish[c.index] = c.finish_reason
    return texts, finish, usage


checks = 0


def check(cond, what):
    global checks
    if not cond:
        raise AssertionError(what)
    checks += 1


# ---- Completions: whole == streamed == decode(mlarun generate) ------------------------
prompt_ids = tok.encode("The latent cache of a DP group", add_special_tokens=False).ids
ref = reference([{"prompt_ids": prompt_ids, "max_tokens": 20, "temperature": 0.8, "seed": 5}])[0]
expected = decode(ref["tokens"])
whole = client.completions.create(model=MODEL, prompt=prompt_ids, max_tokens=20, temperature=0.8, seed=5)
check(whole.choices[0].text == expected, f"whole text {whole.choices[0].text!r} != decode {expected!r}")
check(whole.choices[0].finish_reason == ref["finish_reason"], (whole.choices[0].finish_reason, ref))
check(whole.usage.prompt_tokens == len(prompt_ids), whole.usage)
check(whole.usage.completion_tokens == len(ref["tokens"]), whole.usage)
check(whole.usage.total_tokens == len(prompt_ids) + len(ref["tokens"]), whole.usage)
texts, finish, usage = streamed_text(client.completions.create(
    model=MODEL, prompt=prompt_ids, max_tokens=20, temperature=0.8, seed=5, stream=True,
    stream_options={"include_usage": True}))
check(texts[0] == expected, f"streamed {texts[0]!r} != {expected!r}")
check(finish[0] == ref["finish_reason"], finish)
check(usage is not None and usage.completion_tokens == len(ref["tokens"]), usage)
print(f"completion: {len(ref['tokens'])} tokens, whole == streamed == decode(mlarun generate)")

# A prompt string: whole == streamed.
w = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=12, seed=1, temperature=0.7,
                              extra_body={"ignore_eos": True})
s, _, _ = streamed_text(client.completions.create(model=MODEL, prompt="Hello there", max_tokens=12, seed=1,
                                                  temperature=0.7, stream=True, extra_body={"ignore_eos": True}))
check(w.choices[0].text == s[0], (w.choices[0].text, s[0]))
check(w.usage.completion_tokens == 12, w.usage)

# ---- n = 2: seed and seed + 1 ----------------------------------------------------------
refs = reference([{"prompt_ids": prompt_ids, "max_tokens": 10, "temperature": 1.0, "seed": 9, "ignore_eos": True},
                  {"prompt_ids": prompt_ids, "max_tokens": 10, "temperature": 1.0, "seed": 10, "ignore_eos": True}])
two = client.completions.create(model=MODEL, prompt=prompt_ids, max_tokens=10, temperature=1.0, seed=9, n=2,
                                extra_body={"ignore_eos": True})
by_index = {c.index: c.text for c in two.choices}
check(by_index == {0: decode(refs[0]["tokens"]), 1: decode(refs[1]["tokens"])}, (by_index, refs))
check(by_index[0] != by_index[1], "the two choices are equal")
check(two.usage.completion_tokens == 20, two.usage)
print("n=2: choices are seed and seed+1")

# ---- Stop strings -----------------------------------------------------------------------
long_ref = reference([{"prompt_ids": prompt_ids, "max_tokens": 40, "temperature": 1.0, "seed": 3,
                       "ignore_eos": True}])[0]
full = decode(long_ref["tokens"])
stop = full[len(full) // 2:len(full) // 2 + 2]
want = full[:full.find(stop)]
st = client.completions.create(model=MODEL, prompt=prompt_ids, max_tokens=40, temperature=1.0, seed=3, stop=[stop],
                               extra_body={"ignore_eos": True})
check(st.choices[0].text == want, (st.choices[0].text, want, stop))
check(st.choices[0].finish_reason == "stop", st.choices[0])
sts, stf, _ = streamed_text(client.completions.create(model=MODEL, prompt=prompt_ids, max_tokens=40, temperature=1.0,
                                                      seed=3, stop=stop, stream=True,
                                                      extra_body={"ignore_eos": True}))
check(sts[0] == want and stf[0] == "stop", (sts, stf))
print(f"stop {stop!r}: text cut before it, finish_reason stop")

# ---- Chat --------------------------------------------------------------------------------
messages = [{"role": "user", "content": "Which group serves this?"}]
try:
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, seed=4, temperature=0.6)
except openai.BadRequestError as e:
    # A build without the chat-template interpreter says so, pointing at /v1/completions.
    check("/v1/completions" in str(e), e)
    print(f"chat: refused as this build has no template interpreter: {e}")
else:
    check(chat.choices[0].message.role == "assistant", chat)
    chat_ids = tok.encode(render_chat(messages), add_special_tokens=False).ids
    chat_ref = reference([{"prompt_ids": chat_ids, "max_tokens": 12, "temperature": 0.6, "seed": 4}])[0]
    check(chat.choices[0].message.content == decode(chat_ref["tokens"]),
          (chat.choices[0].message.content, decode(chat_ref["tokens"])))
    check(chat.choices[0].finish_reason == chat_ref["finish_reason"], (chat.choices[0], chat_ref))
    check(chat.usage.prompt_tokens == len(chat_ids), (chat.usage, len(chat_ids)))
    check(chat.usage.completion_tokens == len(chat_ref["tokens"]), chat.usage)
    cs, cf, cu = streamed_text(client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, seed=4, temperature=0.6, stream=True,
        stream_options={"include_usage": True}), chat=True)
    check(cs[0] == chat.choices[0].message.content, (cs, chat.choices[0].message.content))
    check(cf[0] == chat.choices[0].finish_reason, (cf, chat.choices[0].finish_reason))
    check(cu.prompt_tokens == chat.usage.prompt_tokens, (cu, chat.usage))
    print(f"chat: {chat.usage.prompt_tokens} prompt tokens (the template as transformers renders it), "
          "whole == streamed == decode(mlarun generate)")
    # logprobs with top_logprobs: objects of token, logprob and the token's own bytes.
    top_chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, seed=4, temperature=0.6,
                                              logprobs=True, top_logprobs=2)
    top_ref = reference([{"prompt_ids": chat_ids, "max_tokens": 8, "temperature": 0.6, "seed": 4,
                          "logprobs": 2}])[0]
    content = top_chat.choices[0].logprobs.content
    check(len(content) == len(top_ref["tokens"]), (content, top_ref))
    joined = b""
    for entry, token_id, logprob, tops in zip(content, top_ref["tokens"], top_ref["logprobs"],
                                              top_ref["top_logprobs"]):
        check(entry.logprob == logprob and entry.token == decode([token_id]), (entry, token_id, logprob))
        check([(t.token, t.logprob) for t in entry.top_logprobs] == [(decode([i]), l) for i, l in tops],
              (entry.top_logprobs, tops))
        joined += bytes(entry.bytes)
    check(joined.decode("utf-8", errors="replace") == top_chat.choices[0].message.content,
          (joined, top_chat.choices[0].message.content))
    print("chat top_logprobs=2: equal mlarun generate's; the tokens' bytes join into the message")

# ---- Logprobs: the most likely tokens of each step, as mlarun generate lists them ------
lp_ref = reference([{"prompt_ids": prompt_ids, "max_tokens": 6, "temperature": 0.9, "seed": 8, "ignore_eos": True,
                     "logprobs": 3}])[0]
lp = client.completions.create(model=MODEL, prompt=prompt_ids, max_tokens=6, temperature=0.9, seed=8, logprobs=3,
                               extra_body={"ignore_eos": True})
got = lp.choices[0].logprobs
check(got.token_logprobs == lp_ref["logprobs"], (got.token_logprobs, lp_ref["logprobs"]))
check(len(got.top_logprobs) == 6, got.top_logprobs)
for step, (tops, sampled) in enumerate(zip(got.top_logprobs, lp_ref["tokens"])):
    listed = lp_ref["top_logprobs"][step] + [[sampled, lp_ref["logprobs"][step]]]
    check(len(lp_ref["top_logprobs"][step]) == 3, lp_ref)
    # text -> logprob; tokens whose texts coincide keep the likelier one's.
    for token_id, logprob in listed:
        check(tops.get(decode([token_id])) is not None and tops[decode([token_id])] >= logprob,
              (step, token_id, logprob, tops))
    check(len(tops) <= 4, tops)
print("completions logprobs=3: the sampled tokens' logprobs and the 3 most likely of each step equal mlarun generate's")

# echo with logprobs: the prompt's tokens with theirs (as lm-evaluation-harness scores a continuation).
echo_ref = reference([{"prompt_ids": prompt_ids, "max_tokens": 2, "temperature": 0.0, "ignore_eos": True,
                       "logprobs": 1, "prompt_logprobs": 1}])[0]
echoed = client.completions.create(model=MODEL, prompt=prompt_ids, max_tokens=2, temperature=0, echo=True, logprobs=1,
                                   extra_body={"ignore_eos": True})
elp = echoed.choices[0].logprobs
n_prompt = len(prompt_ids)
check(elp.tokens[:n_prompt] == [decode([i]) for i in prompt_ids], (elp.tokens, prompt_ids))
check(elp.token_logprobs[0] is None and elp.top_logprobs[0] is None, elp)
check(elp.token_logprobs[1:n_prompt] == [lp for _, lp in echo_ref["prompt_logprobs"]],
      (elp.token_logprobs, echo_ref["prompt_logprobs"]))
check(elp.token_logprobs[n_prompt:] == echo_ref["logprobs"], (elp.token_logprobs, echo_ref["logprobs"]))
for i, (tops, best) in enumerate(zip(elp.top_logprobs[1:n_prompt], echo_ref["prompt_top_logprobs"])):
    check(tops.get(decode([best[0][0]])) is not None and tops[decode([best[0][0]])] >= best[0][1], (i, tops, best))
check(echoed.choices[0].text == decode(prompt_ids) + decode(echo_ref["tokens"]), echoed.choices[0].text)
# max_tokens=0: the prompt alone with its logprobs.
only = client.completions.create(model=MODEL, prompt=prompt_ids, max_tokens=0, temperature=0, echo=True, logprobs=1)
check(only.choices[0].text == decode(prompt_ids), only.choices[0].text)
check(only.choices[0].logprobs.token_logprobs == elp.token_logprobs[:n_prompt], only.choices[0].logprobs)
check(only.usage.completion_tokens == 0, only.usage)
print(f"completions echo with logprobs: {n_prompt - 1} prompt tokens' logprobs equal mlarun generate's; "
      "max_tokens=0 gives the prompt alone")

# ---- Errors ------------------------------------------------------------------------------
try:
    client.completions.create(model="not-this-one", prompt="x", max_tokens=2)
    check(False, "an unknown model was served")
except openai.NotFoundError as e:
    check(e.status_code == 404, e)
try:
    client.completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=-1)
    check(False, "a negative temperature was accepted")
except openai.BadRequestError as e:
    body = e.body.get("error", e.body) if isinstance(e.body, dict) else {}
    check(body.get("param") == "temperature", e.body)
models = client.models.list()
check([m.id for m in models.data] == [MODEL], models)
# ---- Structured output -----------------------------------------------------------------
# The constraints reach the group (the C++ tests check the wire); whether the
# worker enforces them shows in a grammar it cannot compile: a 400 naming the
# field. A build without the grammar engine refuses them ("off on this
# server"), and these checks are left out, said so below.
class Verdict(pydantic.BaseModel):
    # bool and Literal fields: any greedy walk through the schema ends in a few tokens.
    model_config = pydantic.ConfigDict(extra="forbid")
    ok: bool
    kind: typing.Literal["cat", "dog"]


weather = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                                    "metric": {"type": "boolean"}},
                   "required": ["city", "metric"], "additionalProperties": False}}}


def real_worker_structured():
    """The constraints on the tiny model's worker, and a tool call's round trip."""
    try:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2,
                                  extra_body={"guided_grammar": "root ::= undefined_rule"})
        enforced = False
    except openai.BadRequestError as e:
        body = e.body.get("error", e.body) if isinstance(e.body, dict) else {}
        check(body.get("param") == "guided_grammar", e.body)
        if "off on this server" in str(e):
            print("structured output: refused by this build (no grammar engine); its checks are left out")
            return
        enforced = True
    if not enforced:
        print("structured output: this worker does not enforce constraints (no grammar engine); "
              "the constrained texts are not checked")

    try:
        parsed = client.chat.completions.parse(
            model=MODEL, messages=[{"role": "user", "content": "Judge."}], response_format=Verdict, max_tokens=64,
            temperature=0, extra_body={"structured_outputs": {"disable_any_whitespace": True}})
    except (pydantic.ValidationError, openai.LengthFinishReasonError) as e:
        check(not enforced, f"parse() failed although the worker enforces constraints: {e}")
    else:
        check(not enforced or isinstance(parsed.choices[0].message.parsed, Verdict), parsed)
        if enforced:
            print(f"chat.completions.parse: {parsed.choices[0].message.parsed!r}")

    choices = ["alpha", "beta", "gamma delta"]
    pattern = r"[a-z]{3}-[0-9]{2}"
    for chat in (False, True):
        if chat:
            def ask(**extra):
                r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Pick."}],
                                                   max_tokens=16, temperature=0, extra_body=extra)
                return r.choices[0].message.content
        else:
            def ask(**extra):
                return client.completions.create(model=MODEL, prompt="Pick one:", max_tokens=16, temperature=0,
                                                 extra_body=extra).choices[0].text
        picked = ask(guided_choice=choices)
        matched = ask(guided_regex=pattern)
        if enforced:
            check(picked in choices, picked)
            check(re.fullmatch(pattern, matched) is not None, matched)
            print(f"guided_choice {picked!r} and guided_regex {matched!r} ({'chat' if chat else 'completions'})")
        try:
            ask(guided_choice=choices, guided_regex=pattern)
            check(False, "two constraints were accepted")
        except openai.BadRequestError as e:
            check("guided_regex" in str(e) and "guided_choice" in str(e), e)

    # ---- A named tool call and its result, in DeepSeek-V3's template -----------------------------
    ask_weather = [{"role": "user", "content": "Weather in Paris?"}]
    try:
        called = client.chat.completions.create(
            model=MODEL, messages=ask_weather, tools=[weather], max_tokens=64, temperature=0,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            extra_body={"structured_outputs": {"disable_any_whitespace": True}})
    except openai.BadRequestError as e:
        check("/v1/completions" in str(e), e)  # no template interpreter in this build
    else:
        calls = called.choices[0].message.tool_calls
        check(calls is not None and len(calls) == 1, called)
        check(calls[0].type == "function" and calls[0].function.name == "get_weather" and calls[0].id, calls)
        if enforced:
            args = json.loads(calls[0].function.arguments)
            check(set(args) == {"city", "metric"} and args["city"] in ("Paris", "Oslo") and
                  isinstance(args["metric"], bool), args)
            check(called.choices[0].finish_reason == "tool_calls", called.choices[0])
        answered = ask_weather + [
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": calls[0].id, "type": "function",
                 "function": {"name": "get_weather", "arguments": calls[0].function.arguments}}]},
            {"role": "tool", "tool_call_id": calls[0].id, "content": '{"temperature_c": 21, "sky": "clear"}'}]
        final = client.chat.completions.create(model=MODEL, messages=answered, max_tokens=10, seed=6, temperature=0.5)
        final_ids = tok.encode(render_chat(answered), add_special_tokens=False).ids
        final_ref = reference([{"prompt_ids": final_ids, "max_tokens": 10, "temperature": 0.5, "seed": 6}])[0]
        check(final.usage.prompt_tokens == len(final_ids), (final.usage, len(final_ids)))
        check(final.choices[0].message.content == decode(final_ref["tokens"]),
              (final.choices[0].message.content, decode(final_ref["tokens"])))
        check(not final.choices[0].message.tool_calls, final)
        print(f"tool round trip: get_weather({calls[0].function.arguments}) then the result; the second prompt "
              f"({len(final_ids)} tokens) is the template as transformers renders it")


real_worker_structured()

# ---- A constrained answer's shape, as the client reads it -------------------------------------
# The simulated group answers json_script_text whatever the constraint: the
# client's parse() and tool_calls of the server's answers.
scripted = openai.OpenAI(base_url=json_base_url, api_key="unused", max_retries=0, timeout=60)
want_verdict = Verdict.model_validate_json(json_script_text)
got = scripted.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "Judge."}],
                                      response_format=Verdict, max_tokens=64)
check(got.choices[0].message.parsed == want_verdict, got)
judge = {"type": "function", "function": {"name": "judge", "parameters": Verdict.model_json_schema()}}
named = {"type": "function", "function": {"name": "judge"}}
got = scripted.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Judge."}],
                                       tools=[weather, judge], tool_choice=named, max_tokens=64)
calls = got.choices[0].message.tool_calls
check(len(calls) == 1 and calls[0].function.name == "judge" and calls[0].id, got)
check(calls[0].function.arguments == json_script_text, calls)
check(got.choices[0].finish_reason == "tool_calls" and got.choices[0].message.content is None, got)
pieces, names, finish = [], [], None
for chunk in scripted.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Judge."}],
                                              tools=[weather, judge], tool_choice=named, max_tokens=64,
                                              stream=True):
    for c in chunk.choices:
        for t in c.delta.tool_calls or []:
            check(t.index == 0, t)
            if t.function.name is not None:
                names.append(t.function.name)
            pieces.append(t.function.arguments or "")
        finish = c.finish_reason or finish
check(names == ["judge"] and "".join(pieces) == json_script_text and len(pieces) > 1, (names, pieces))
check(finish == "tool_calls", finish)
print(f"scripted JSON: parse() gives {want_verdict!r}; a named call's arguments whole and in {len(pieces)} deltas")

# ---- R1 reasoning, streamed: reasoning_content deltas, then content --------------------------
r1 = openai.OpenAI(base_url=r1_base_url, api_key="unused", max_retries=0, timeout=60)
end = r1_script_text.find("</think>")
want_reasoning = r1_script_text[:end].removeprefix("<think>")
want_content = r1_script_text[end + len("</think>"):]
reasoning, content, order = "", "", []
for chunk in r1.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Think."}],
                                        max_tokens=200, stream=True):
    for c in chunk.choices:
        r = getattr(c.delta, "reasoning_content", None) or ""
        t = c.delta.content or ""
        reasoning += r
        content += t
        if r:
            order.append("reasoning")
        if t:
            order.append("content")
check(reasoning == want_reasoning, (reasoning, want_reasoning))
check(content == want_content, (content, want_content))
check(order == sorted(order, key=lambda kind: kind == "content") and len(set(order)) == 2, order)
print(f"R1 stream: {order.count('reasoning')} reasoning deltas, then {order.count('content')} content deltas")

print(f"openai_client_test.py: {checks} checks passed")
