"""The OpenAI sampling features through the official `openai` client,
against real services, each request sent twice: to a gateway whose target
speculates through aerie-draft (a tree every step), and to one whose target
has no draft. Log-probabilities, penalties, biases, min_tokens and stop ids
must give the same output on both, to the bit; bad values get their 400.
"""
import math
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

import aerie_rpc as rpc
from test_gateway import CTX, Gateway, Proc, request
from test_services import HEAD

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers."]


@pytest.fixture(scope="module")
def pair(tmp_path_factory, model):
    """(speculating gateway, plain gateway)."""
    tmp = tmp_path_factory.mktemp("pair")
    procs = []
    draft_addr = f"unix:{tmp}/draft.sock"
    d = Proc("aerie-draft", ["--model", model, "--draft", HEAD, "--listen", draft_addr, "--max-seqs", "64",
                             "--max-seq-len", CTX, "--threads", "1"], tmp)
    procs.append(d)
    rpc.wait_for_socket(draft_addr, d.proc)
    gws = []
    for tag, extra in (("spec", ["--draft-addr", draft_addr, "--no-spec-adaptive", "--draft-deadline-ms", "5000"]),
                       ("plain", [])):
        addr = f"unix:{tmp}/{tag}.sock"
        t = Proc("aerie-target", ["--model", model, "--listen", addr, "--max-batch", "8", "--max-seq-len", CTX,
                                  "--threads", "1", "--log-interval-s", "0", *extra], tmp, tag=f"target-{tag}")
        procs.append(t)
        rpc.wait_for_socket(addr, t.proc)
        g = Gateway(model, [addr], tmp, tag=f"gateway-{tag}")
        procs.append(g)
        g.wait_healthy()
        g.name = "SmolLM2-135M-Instruct.Q4_1"
        gws.append(g)
    yield gws
    for p in reversed(procs):
        rc = p.stop()
        assert rc == 0, f"{p.name} exited {rc}:\n{p.text()[-3000:]}"


def both(pair, fn):
    """fn(client, model name) on each gateway at once (they have their own
    targets, and the machine two cores): (speculative, plain)."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = [pool.submit(fn, g.client(), g.name) for g in pair]
        return tuple(f.result() for f in futures)


def chat(question, **kw):
    def go(c, name):
        return c.chat.completions.create(model=name, messages=[{"role": "user", "content": question}], **kw)
    return go


def lp_list(choice):
    return [(e.token, e.logprob, list(e.bytes), [(t.token, t.logprob, list(t.bytes)) for t in e.top_logprobs])
            for e in choice.logprobs.content]


def test_chat_logprobs_are_the_same_with_and_without_the_draft_and_streamed(pair):
    for q in QUESTIONS:
        spec, plain = both(pair, chat(q, max_tokens=24, temperature=0, logprobs=True, top_logprobs=5))
        s, p = spec.choices[0], plain.choices[0]
        assert s.message.content == p.message.content
        assert lp_list(s) == lp_list(p)
        entries = lp_list(s)
        assert len(entries) == spec.usage.completion_tokens
        # Greedy: every token is its position's most likely, and the bytes
        # of the tokens are the text.
        assert b"".join(bytes(e[2]) for e in entries).decode() == s.message.content
        for tok, lp, _, top in entries:
            assert len(top) == 5
            assert top[0][1] == lp and top[0][0] == tok
            assert all(top[k][1] >= top[k + 1][1] for k in range(4))
            assert lp <= 0 and sum(math.exp(t[1]) for t in top) <= 1 + 1e-6
        # Streamed: the chunks' entries, joined, are the whole reply's.
        streamed = []
        for g in pair:
            chunks = g.client().chat.completions.create(
                model=g.name, messages=[{"role": "user", "content": q}], max_tokens=24, temperature=0,
                logprobs=True, top_logprobs=5, stream=True)
            got = []
            for c in chunks:
                for ch in c.choices:
                    if ch.logprobs and ch.logprobs.content:
                        got += [(e.token, e.logprob, list(e.bytes),
                                 [(t.token, t.logprob, list(t.bytes)) for t in e.top_logprobs])
                                for e in ch.logprobs.content]
            streamed.append(got)
        assert streamed[0] == entries and streamed[1] == entries


def test_completions_logprobs_have_openai_s_four_lists(pair):
    def go(c, name):
        return c.completions.create(model=name, prompt="The capital of France is", max_tokens=12, temperature=0,
                                    logprobs=3)
    spec, plain = both(pair, go)
    s, p = spec.choices[0].logprobs, plain.choices[0].logprobs
    assert (s.tokens, s.token_logprobs, s.top_logprobs, s.text_offset) == \
           (p.tokens, p.token_logprobs, p.top_logprobs, p.text_offset)
    n = spec.usage.completion_tokens
    assert len(s.tokens) == len(s.token_logprobs) == len(s.top_logprobs) == len(s.text_offset) == n
    assert "".join(s.tokens) == spec.choices[0].text
    offs = [sum(len(t) for t in s.tokens[:i]) for i in range(n)]
    assert s.text_offset == offs
    for tok, lp, top in zip(s.tokens, s.token_logprobs, s.top_logprobs):
        assert 1 <= len(top) <= 3 and max(top.values()) == lp and top.get(tok) == lp


def test_penalties_and_biases_change_greedy_output_identically_with_and_without_the_draft(pair):
    base = both(pair, chat(QUESTIONS[1], max_tokens=40, temperature=0))
    assert base[0].choices[0].message.content == base[1].choices[0].message.content
    kw = dict(max_tokens=40, temperature=0, frequency_penalty=1.0, presence_penalty=0.5,
              extra_body={"repetition_penalty": 1.3})
    spec, plain = both(pair, chat(QUESTIONS[1], logprobs=True, **kw))
    assert spec.choices[0].message.content == plain.choices[0].message.content
    assert spec.choices[0].message.content != base[0].choices[0].message.content
    assert lp_list(spec.choices[0]) == lp_list(plain.choices[0])
    # Sampled with a seed: the same tokens on both.
    spec, plain = both(pair, chat(QUESTIONS[2], max_tokens=40, temperature=0.9, seed=7, frequency_penalty=0.8,
                                  logit_bias={"28": 5}))
    assert spec.choices[0].message.content == plain.choices[0].message.content


def test_logit_bias_bans_a_token_and_stop_token_ids_end_the_output(pair):
    first = both(pair, chat(QUESTIONS[0], max_tokens=12, temperature=0, logprobs=True))[1]
    entries = first.choices[0].logprobs.content

    def ids_of(text):
        st, _h, body = request(pair[1].port, "POST", "/tokenize", {"prompt": text})
        assert st == 200
        return body["tokens"]

    banned = ids_of(entries[0].token)
    assert len(banned) == 1
    spec, plain = both(pair, chat(QUESTIONS[0], max_tokens=12, temperature=0, logprobs=True,
                                  logit_bias={str(banned[0]): -100}))
    assert spec.choices[0].message.content == plain.choices[0].message.content
    assert spec.choices[0].logprobs.content[0].token != entries[0].token
    # The third token of the unbiased reply, as a stop id: the reply is
    # its first two tokens, finished by "stop".
    stop_id = ids_of(entries[2].token)
    assert len(stop_id) == 1
    spec, plain = both(pair, chat(QUESTIONS[0], max_tokens=12, temperature=0, extra_body={"stop_token_ids": stop_id}))
    for r in (spec, plain):
        assert r.choices[0].finish_reason == "stop"
        assert r.usage.completion_tokens == 2
        assert r.choices[0].message.content == entries[0].token + entries[1].token


def test_min_tokens_holds_back_the_end_of_sequence(pair):
    short = both(pair, chat(QUESTIONS[0], max_tokens=64, temperature=0))[1]
    n = short.usage.completion_tokens
    assert short.choices[0].finish_reason == "stop" and n < 30
    spec, plain = both(pair, chat(QUESTIONS[0], max_tokens=64, temperature=0, extra_body={"min_tokens": n + 8}))
    assert spec.choices[0].message.content == plain.choices[0].message.content
    assert spec.usage.completion_tokens >= n + 8


@pytest.mark.parametrize("kw,param,msg", [
    (dict(logprobs=True, top_logprobs=21), "top_logprobs", "'top_logprobs' is 21; it must be between 0 and 20"),
    (dict(top_logprobs=2), "top_logprobs", "'top_logprobs' needs 'logprobs': true"),
    (dict(frequency_penalty=-2.5), "frequency_penalty", "'frequency_penalty' is -2.5; it must be >= -2 and <= 2"),
    (dict(logit_bias={"49152": 1}), "logit_bias", "'logit_bias' names token 49152; the vocabulary has 49152"),
    (dict(logit_bias={"x": 1}), "logit_bias", "'logit_bias' key 'x' is not a token id"),
    (dict(extra_body={"stop_token_ids": [1, 99999]}), "stop_token_ids",
     "stop_token_ids[1] is 99999; the vocabulary has 49152"),
    (dict(max_tokens=4, extra_body={"min_tokens": 5}), "min_tokens", "min_tokens (5) is more than max_tokens (4)"),
])
def test_bad_values_get_a_400_naming_the_parameter(pair, kw, param, msg):
    g = pair[0]
    with pytest.raises(openai.BadRequestError) as ei:
        g.client().chat.completions.create(model=g.name, messages=[{"role": "user", "content": "hi"}], **kw)
    err = ei.value.body
    assert err["param"] == param and err["message"] == msg
    # and it keeps serving
    r = g.client().chat.completions.create(model=g.name, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert r.usage.completion_tokens == 2


def choice_texts(r):
    return [c.message.content for c in sorted(r.choices, key=lambda c: c.index)]


def gateway_spec_steps(g):
    import re
    st, _h, text = request(g.port, "GET", "/metrics")
    return sum(int(re.search(rf"^{name} (\d+)$", text, re.M).group(1))
               for name in ("aerie_spec_draft_steps_total", "aerie_spec_plain_steps_total"))


def spec_figures(g):
    """The speculating target's figures, once the gateway has fetched them
    after the last request."""
    time.sleep(0.6)  # three health intervals
    st, _h, info = request(g.port, "GET", "/server_info")
    assert st == 200
    return info["targets"][0]["stats"]["spec"]


def test_n_choices_are_keyed_by_seed_and_index_and_the_same_with_and_without_the_draft(pair):
    kw = dict(max_tokens=20, temperature=0.9, seed=11, n=4, logprobs=True)
    before, gw_before = spec_figures(pair[0]), gateway_spec_steps(pair[0])
    spec, plain = both(pair, chat(QUESTIONS[1], **kw))
    after, gw_after = spec_figures(pair[0]), gateway_spec_steps(pair[0])
    # Every choice's last event carries its own figures: the gateway's sum
    # is the target's.
    assert gw_after - gw_before == (after["steps"] + after["plain_steps"]) - (before["steps"] + before["plain_steps"])
    # Every choice drafted: the forks took their source's state at the
    # draft service, none was lost.
    assert after["state_gone"] == before["state_gone"] and after["draft_failures"] == before["draft_failures"]
    assert after["steps"] - before["steps"] >= 4 and after["accepted"] > before["accepted"]
    assert [c.index for c in spec.choices] == [0, 1, 2, 3]
    assert choice_texts(spec) == choice_texts(plain)
    assert len(set(choice_texts(spec))) >= 3  # other keys, other draws
    again = both(pair, chat(QUESTIONS[1], **kw))[0]
    assert choice_texts(again) == choice_texts(spec)
    # usage counts every choice; each choice's tokens have their entries
    assert spec.usage.completion_tokens == sum(len(c.logprobs.content) for c in spec.choices)
    assert spec.usage.prompt_tokens == plain.usage.prompt_tokens
    # Choice 0 is the single choice of the same seed.
    one = both(pair, chat(QUESTIONS[1], max_tokens=20, temperature=0.9, seed=11))[1]
    assert one.choices[0].message.content == choice_texts(spec)[0]
    # Greedy choices are all the greedy reply.
    greedy = both(pair, chat(QUESTIONS[0], max_tokens=12, temperature=0, n=3))
    assert len(set(choice_texts(greedy[0]) + choice_texts(greedy[1]))) == 1


def test_streamed_choices_are_interleaved_by_index_and_each_finishes(pair):
    g = pair[0]
    kw = dict(model=g.name, messages=[{"role": "user", "content": QUESTIONS[2]}], max_tokens=16, temperature=0.8,
              seed=3, n=3)
    whole = g.client().chat.completions.create(**kw)
    texts, finish, roles, order = {}, {}, {}, []
    for c in g.client().chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if c.usage:
            assert c.usage.completion_tokens == whole.usage.completion_tokens
        for ch in c.choices:
            order.append(ch.index)
            if ch.delta.role:
                roles[ch.index] = ch.delta.role
            texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
            if ch.finish_reason:
                finish[ch.index] = ch.finish_reason
    assert [texts[i] for i in range(3)] == choice_texts(whole)
    assert finish == {c.index: c.finish_reason for c in whole.choices}
    assert roles == {0: "assistant", 1: "assistant", 2: "assistant"}
    assert order != sorted(order)  # interleaved, not one choice after another


def test_n_beyond_the_target_s_batch_is_refused(pair):
    g = pair[0]
    with pytest.raises(openai.BadRequestError) as ei:
        g.client().chat.completions.create(model=g.name, messages=[{"role": "user", "content": "hi"}], n=9)
    assert ei.value.body["message"] == "n of 9 needs 9 sequences at once; this target runs at most 8"
