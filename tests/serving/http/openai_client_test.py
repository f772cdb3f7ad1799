"""The coordinator's HTTP API through the official openai client (run by
openai_client_test.sh, which starts the deployment).

  openai_client_test.py BASE_URL TOKENIZER_JSON GENERATE_HELPER SCRATCH_DIR

GENERATE_HELPER runs `mlarun generate --prompts FILE --json` on the tiny
model: the reference tokens for a prompt and seed.
"""
import json
import os
import subprocess
import sys

import jinja2
import jinja2.ext
import jinja2.sandbox
import openai
from tokenizers import Tokenizer

base_url, tokenizer_json, generate, scratch = sys.argv[1:5]
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
print(f"openai_client_test.py: {checks} checks passed")
