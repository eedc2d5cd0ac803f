"""Structured output (response_format) through the official `openai` client:
every schema x prompt gives JSON that validates against its schema with
the `jsonschema` package, the same text with and without the draft, and
schemas outside the supported subset get a 400 naming the keyword.
"""
import json

import jsonschema
import openai
import pytest

from test_sampling_api import both, pair  # noqa: F401 (the fixture)

S = {"type": "string", "maxLength": 24}
# An integer without bounds lets a small model write digits until
# max_tokens; the schemas that are not about that bound theirs.
SMALL = {"type": "integer", "minimum": 0, "maximum": 1000}
SCHEMAS = [
    {"type": "object", "properties": {"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"kind": {"const": "fruit"}, "name": S}, "required": ["kind", "name"]},
    # The integer is bounded: unbounded, the model at 8-bit activations
    # writes digits until max_tokens on one prompt, and the test is of the
    # grammar, not of when the model stops.
    {"type": "object", "properties": {"v": {"anyOf": [{"type": "integer", "minimum": -999, "maximum": 999}, S]}},
     "required": ["v"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": S, "minItems": 1, "maxItems": 3}},
     "required": ["tags"]},
    {"type": "object", "properties": {"code": {"type": "string", "minLength": 3, "maxLength": 6}},
     "required": ["code"]},
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": 10, "maximum": 99}}, "required": ["n"]},
    {"type": "object", "properties": {"person": {"type": "object", "properties": {"first": S, "last": S},
                                                 "required": ["first", "last"], "additionalProperties": False}},
     "required": ["person"]},
    {"$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                      "required": ["x", "y"]}},
     "type": "object", "properties": {"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}},
     "required": ["a", "b"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "none": {"type": "null"}},
     "required": ["ok", "none"]},
    {"type": "object", "properties": {"price": {"type": "number", "minimum": 0, "maximum": 1000}},
     "required": ["price"]},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"id": {"type": "integer"}, "label": S}, "required": ["id", "label"]}}},
     "required": ["items"]},
    {"type": "object", "properties": {"note": {"type": ["string", "null"], "maxLength": 20}}, "required": ["note"]},
    {"type": "object", "properties": {"k": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 5}},
     "required": ["k"]},
    {"type": "object", "properties": {"level": {"enum": [1, 2, 3]}}, "required": ["level"]},
    {"type": "object", "properties": {"city": S, "zip": S}, "additionalProperties": False},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {
        "c": {"type": "integer"}}, "required": ["c"]}}, "required": ["b"]}}, "required": ["a"]},
    {"type": "object", "properties": {"days": {"type": "array", "maxItems": 3,
                                               "items": {"enum": ["mon", "tue", "wed"]}}}, "required": ["days"]},
    {"type": "object", "properties": {"shape": {"anyOf": [
        {"type": "object", "properties": {"r": SMALL}, "required": ["r"], "additionalProperties": False},
        {"type": "object", "properties": {"w": SMALL, "h": SMALL}, "required": ["w", "h"],
         "additionalProperties": False}]}}, "required": ["shape"]},
    {"title": "answer", "description": "an answer", "type": "object",
     "properties": {"answer": {"type": "string", "maxLength": 40, "description": "the answer"}},
     "required": ["answer"]},
]
PROMPTS = ["Give me a JSON object.", "Describe the capital of France as JSON."]


def ask(schema, prompt, **kw):
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": schema, "strict": True}}

    def go(c, name):
        return c.chat.completions.create(model=name, messages=[{"role": "user", "content": prompt}],
                                         max_tokens=160, temperature=0, response_format=fmt, **kw)
    return go


@pytest.mark.parametrize("i", range(len(SCHEMAS)))
def test_outputs_validate_against_their_schema_and_equal_plain(pair, i):  # noqa: F811
    schema = SCHEMAS[i]
    for prompt in PROMPTS:
        spec, plain = both(pair, ask(schema, prompt))
        text = spec.choices[0].message.content
        assert text == plain.choices[0].message.content
        assert spec.choices[0].finish_reason == "stop", text
        jsonschema.validate(json.loads(text), schema)


def test_json_object_mode_and_sampled_constrained_output(pair):  # noqa: F811
    def go(c, name):
        return c.chat.completions.create(model=name, messages=[{"role": "user", "content": "List two colors."}],
                                         max_tokens=120, temperature=0.8, seed=5, n=3,
                                         response_format={"type": "json_object"})
    spec, plain = both(pair, go)
    assert [c.message.content for c in spec.choices] == [c.message.content for c in plain.choices]
    for c in spec.choices:
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.message.content), dict)


@pytest.mark.parametrize("schema,msg", [
    ({"type": "object", "properties": {"z": {"type": "string", "pattern": "^[0-9]+$"}}},
     "'pattern' at #/properties/z is not supported"),
    ({"type": "object", "oneOf": [{"type": "object"}]}, "'oneOf' at # is not supported"),
    ({"type": "object", "additionalProperties": True},
     "'additionalProperties' at # is supported only as false (no properties besides the listed ones)"),
    ({"type": "object", "properties": {"a": {"$ref": "http://x/y"}}},
     "'$ref' at #/properties/a must point into this document (\"#/$defs/name\")"),
    ({"type": "integer", "multipleOf": 3}, "'multipleOf' at # is not supported"),
])
def test_schemas_outside_the_subset_are_refused_naming_the_keyword(pair, schema, msg):  # noqa: F811
    assert_refused(pair[0], schema, msg)


def assert_refused(g, schema, msg):
    """A json_schema request with schema is a 400 on response_format that says msg."""
    with pytest.raises(openai.BadRequestError) as ei:
        g.client().chat.completions.create(
            model=g.name, messages=[{"role": "user", "content": "hi"}],
            response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": schema}})
    assert ei.value.body["param"] == "response_format" and ei.value.body["message"] == msg


def test_metrics_count_constrained_requests_and_mask_time_and_server_info_lists_features(pair):  # noqa: F811
    import re
    import time
    from test_gateway import request
    g = pair[0]
    both(pair, ask(SCHEMAS[0], PROMPTS[0]))
    time.sleep(0.6)  # the gateway fetches the targets' figures every 200 ms
    st, _h, text = request(g.port, "GET", "/metrics")
    assert st == 200
    assert int(re.search(r"^aerie_constrained_requests_total (\d+)$", text, re.M).group(1)) >= 1
    masks = float(re.search(r'^aerie_grammar_masks_total\{target="[^"]+"\} (\S+)$', text, re.M).group(1))
    secs = float(re.search(r'^aerie_grammar_mask_seconds_total\{target="[^"]+"\} (\S+)$', text, re.M).group(1))
    assert masks >= 10 and 0 < secs < masks * 50e-6 * 10  # well under 50 us a mask, with room for ASan
    st, _h, info = request(g.port, "GET", "/server_info")
    f = info["gateway"]["features"]
    assert f["response_format"] == ["text", "json_object", "json_schema"] and f["n_max"] == 16
    assert f["top_logprobs_max"] == 20 and "anyOf" in f["json_schema_keywords"]
    assert info["targets"][0]["stats"]["requests_constrained"] >= 1
    sc = info["targets"][0]["stats"]["schemas"]
    assert set(sc) == {"compiling", "ok", "refused", "timeout", "cancelled", "errors", "dropped", "threads",
                       "mask_budget_spent"}
    assert sc["ok"] >= 1 and sc["compiling"] == 0 and sc["errors"] == 0 and sc["mask_budget_spent"] == 0


def test_min_tokens_yields_to_a_complete_value(pair):  # noqa: F811
    """min_tokens holds back the end of sequence, but once the value is
    complete nothing else is allowed: the grammar wins."""
    spec, plain = both(pair, ask({"type": "boolean"}, PROMPTS[0], extra_body={"min_tokens": 10}))
    assert spec.choices[0].message.content == plain.choices[0].message.content
    assert json.loads(spec.choices[0].message.content) in (True, False)


@pytest.mark.parametrize("schema,start", [
    ({"type": "array", "minItems": 1}, "the schema cannot be compiled: "),
    ({"type": "string", "minLength": 5, "maxLength": 2}, "'minLength' at # is more than 'maxLength'"),
])
def test_schemas_that_allow_nothing_or_do_not_compile_are_a_400(pair, schema, start):  # noqa: F811
    g = pair[0]
    with pytest.raises(openai.BadRequestError) as ei:
        g.client().chat.completions.create(
            model=g.name, messages=[{"role": "user", "content": "hi"}],
            response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": schema}})
    msg = ei.value.body["message"]
    assert msg.startswith(start) and ".cc:" not in msg and "build/" not in msg, msg


@pytest.mark.serial
def test_a_slow_schema_compile_does_not_stall_other_requests(pair):  # noqa: F811
    """Schemas compile on their own thread: a large one (seconds) leaves
    the target serving everyone else meanwhile."""
    import threading
    import time
    g = pair[1]
    # 1,900 required strings and a 1,000-value enum: 1.2 s to compile in a
    # release build, within the limits (104 KB, 1,902 schemas).
    props = {f"p{i}": {"type": "string", "maxLength": 4} for i in range(1900)}
    props["pick"] = {"enum": [f"value{i:07d}" for i in range(1000)]}
    big = {"type": "object", "properties": props, "required": list(props)}
    done = {}

    def slow():
        g.client().chat.completions.create(
            model=g.name, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
            response_format={"type": "json_schema", "json_schema": {"name": "big", "schema": big}})
        done["slow"] = time.monotonic()

    t = threading.Thread(target=slow)
    t.start()
    time.sleep(0.5)
    t0 = time.monotonic()
    r = g.client().chat.completions.create(model=g.name, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                           temperature=0)
    done["fast"] = time.monotonic()
    t.join()
    assert r.usage.completion_tokens == 8
    print(f"fast request: {done['fast'] - t0:.2f} s; the big schema's request ended "
          f"{done['slow'] - done['fast']:.2f} s after it")
    assert done["fast"] < done["slow"]


@pytest.mark.parametrize("schema,msg", [
    ({"type": "object", "properties": {"v": {"enum": [f"v{i:013d}" for i in range(1025)]}}},
     "'enum' at #/properties/v has 1025 values; at most 1024"),
    ({"type": "array", "items": {"anyOf": [{"type": "string", "minLength": i, "maxLength": i + 3 + i % 5}
                                           for i in range(1500)]}},
     "'anyOf' at #/items has 1500 alternatives; at most 64"),
    ({"type": "string", "maxLength": 10001}, "'maxLength' at # is 10001; at most 10000"),
    ({"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(300)}},
     "'properties' at # has 300 properties that are not required; at most 256"),
    ({"$ref": "#/"}, "'$ref' at # must point into this document (\"#/$defs/name\")"),
    ({"type": "number", "exclusiveMinimum": 5, "exclusiveMaximum": 2},
     "'exclusiveMinimum' 5 at # leaves no number below 'exclusiveMaximum' 2"),
])
def test_schemas_past_a_limit_are_a_400_naming_it(pair, schema, msg):  # noqa: F811
    """The limits that bound a compile's time and a mask's (gateway/schema.h):
    the 1,500-alternative schema that slowed every stream 20 times, and the
    kind of enum that compiled for seconds, are refused before they reach
    a target."""
    g = pair[0]
    assert_refused(g, schema, msg)
    r = g.client().chat.completions.create(model=g.name, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                           temperature=0, response_format={"type": "json_object"})
    assert r.choices[0].message.content.startswith("{")
