"""Tools through the official `openai` client (README, "Tools"): with
tool_choice required or a named function the reply is a call whose
arguments validate against the function's parameters, the same with and
without the draft, whole or streamed; a conversation carrying calls and
their results is accepted; bad tools get a 400 naming them.
"""
import json

import jsonschema
import openai
import pytest

from test_sampling_api import both, pair  # noqa: F401 (the fixture)

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                                        "b": {"type": "integer", "minimum": -1000, "maximum": 1000}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "The sum of two integers",
                                           "parameters": ADD}}]
PARAMS = {"get_weather": WEATHER, "add": ADD}
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]


def call(tool_choice, msgs=MSGS, **kw):
    def go(c, name):
        return c.chat.completions.create(model=name, messages=msgs, tools=TOOLS, tool_choice=tool_choice,
                                         max_tokens=80, temperature=0, **kw)
    return go


@pytest.mark.parametrize("tool_choice,want", [
    ("required", None),
    ({"type": "function", "function": {"name": "add"}}, "add"),
    ({"type": "function", "function": {"name": "get_weather"}}, "get_weather"),
])
def test_required_and_named_calls_match_their_parameters(pair, tool_choice, want):  # noqa: F811
    spec, plain = both(pair, call(tool_choice))
    for r in (spec, plain):
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls" and ch.message.content is None
        [tc] = ch.message.tool_calls
        assert tc.type == "function" and tc.id.startswith("call_")
        assert want is None or tc.function.name == want
        jsonschema.validate(json.loads(tc.function.arguments), PARAMS[tc.function.name])
    assert spec.choices[0].message.tool_calls[0].function.model_dump() == \
        plain.choices[0].message.tool_calls[0].function.model_dump()


def test_a_streamed_call_arrives_as_a_tool_call_delta(pair):  # noqa: F811
    g = pair[0]
    whole = g.client().chat.completions.create(model=g.name, messages=MSGS, tools=TOOLS, tool_choice="required",
                                               max_tokens=80, temperature=0)
    deltas, finish, content = [], None, ""
    for c in g.client().chat.completions.create(model=g.name, messages=MSGS, tools=TOOLS, tool_choice="required",
                                                max_tokens=80, temperature=0, stream=True):
        for ch in c.choices:
            content += ch.delta.content or ""
            deltas += ch.delta.tool_calls or []
            finish = ch.finish_reason or finish
    assert finish == "tool_calls" and content == ""
    [d] = deltas
    w = whole.choices[0].message.tool_calls[0]
    assert d.index == 0 and d.function.name == w.function.name and d.function.arguments == w.function.arguments


def test_a_conversation_with_calls_and_results_is_served(pair):  # noqa: F811
    msgs = MSGS + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"unit\": \"celsius\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21, \"sky\": \"clear\"}"}]
    spec, plain = both(pair, call("auto", msgs))
    assert spec.choices[0].message.content == plain.choices[0].message.content
    assert spec.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # tool_choice none: no call, plain text
    spec, plain = both(pair, call("none", MSGS))
    assert spec.choices[0].message.tool_calls is None and spec.choices[0].message.content
    assert spec.choices[0].message.content == plain.choices[0].message.content


@pytest.mark.parametrize("kw,param,msg", [
    (dict(tools=[{"type": "function", "function": {"name": "bad name"}}]), "tools",
     "tools[0].function.name must be 1 to 64 of a-z, A-Z, 0-9, _ and -"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice",
     "'tool_choice' names 'nope', which is not in tools"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "not": {}}}}]),
     "tools", "tools[0].function.parameters: 'not' at # is not supported"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "$defs": {"u": {"type": "string"}}, "type": "object", "properties": {"a": {"$ref": "#/$defs/u"}}}}}]),
     "tools", "tools[0].function.parameters: '$defs' and '$ref' are not supported in tool parameters"),
])
def test_bad_tools_get_a_400(pair, kw, param, msg):  # noqa: F811
    g = pair[0]
    with pytest.raises(openai.BadRequestError) as ei:
        g.client().chat.completions.create(model=g.name, messages=MSGS, **kw)
    assert ei.value.body["param"] == param and ei.value.body["message"] == msg
