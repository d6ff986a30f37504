"""Structured outputs and tool calls through the official openai client, against a real server on
the embedded SmolLM2-135M-Instruct: every constrained output validates, streamed or not."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import pytest
from helpers import Server
from pydantic import BaseModel, Field

pytestmark = pytest.mark.slow  # end to end: server processes, peers, workers, the default model

ADDRESS = {"type": "object", "properties": {"street": {"type": "string", "maxLength": 40},
                                            "city": {"type": "string", "maxLength": 30},
                                            "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
           "required": ["street", "city", "zip"], "additionalProperties": False}

# (what to ask for, schema): nesting, enums, arrays with bounds, number ranges, patterns,
# optional / required, anyOf, $ref
SCHEMAS: list[tuple[str, dict]] = [
    ("a person", {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                                   "age": {"type": "integer", "minimum": 0, "maximum": 120}},
                  "required": ["name", "age"]}),
    ("a color", {"type": "string", "enum": ["red", "green", "blue"]}),
    ("a number between 1 and 10", {"type": "integer", "minimum": 1, "maximum": 10}),
    ("a probability", {"type": "number", "minimum": 0, "maximum": 1}),
    ("a yes/no answer", {"type": "boolean"}),
    ("three fruits", {"type": "array", "items": {"type": "string", "maxLength": 20}, "minItems": 3, "maxItems": 3}),
    ("one to four scores", {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100},
                            "minItems": 1, "maxItems": 4}),
    ("an address", ADDRESS),
    ("a company with an address", {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                                                    "hq": ADDRESS},
                                   "required": ["name", "hq"]}),
    ("a phone number", {"type": "string", "pattern": "^\\+?[0-9]{3}-[0-9]{3}-[0-9]{4}$"}),
    ("a date", {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}),
    ("a product code", {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{3}$"}},
                        "required": ["code"]}),
    ("a book, maybe with a year", {"type": "object", "properties": {"title": {"type": "string", "maxLength": 40},
                                                                    "year": {"type": "integer", "minimum": 1000,
                                                                             "maximum": 2100}},
                                   "required": ["title"]}),
    ("a user with optional email", {"type": "object", "properties": {"user": {"type": "string", "maxLength": 20},
                                                                      "email": {"type": "string", "maxLength": 40},
                                                                      "admin": {"type": "boolean"}},
                                    "required": ["user", "admin"]}),
    ("an id: a number or a string", {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9999},
                                               {"type": "string", "pattern": "^id-[a-z]{2,6}$"}]}),
    ("a shape", {"anyOf": [
        {"type": "object", "properties": {"kind": {"const": "circle"}, "r": {"type": "number", "minimum": 0,
                                                                             "maximum": 100}},
         "required": ["kind", "r"]},
        {"type": "object", "properties": {"kind": {"const": "square"}, "side": {"type": "integer", "minimum": 1,
                                                                                "maximum": 50}},
         "required": ["kind", "side"]}]}),
    ("a pet", {"type": "object", "properties": {"species": {"type": "string", "enum": ["cat", "dog", "fish"]},
                                                "name": {"type": "string", "maxLength": 20},
                                                "legs": {"type": "integer", "enum": [0, 2, 4]}},
               "required": ["species", "name", "legs"]}),
    ("a temperature reading", {"type": "object", "properties": {
        "celsius": {"type": "number", "minimum": -90, "maximum": 60},
        "unit": {"const": "C"}}, "required": ["celsius", "unit"]}),
    ("a point", {"type": "array", "prefixItems": [{"type": "integer", "minimum": -100, "maximum": 100},
                                                  {"type": "integer", "minimum": -100, "maximum": 100}],
                 "items": False, "minItems": 2}),
    ("a team", {"type": "object", "properties": {
        "team": {"type": "string", "maxLength": 20},
        "members": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
            "type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                             "role": {"type": "string", "enum": ["lead", "dev", "qa"]}},
            "required": ["name", "role"]}}}, "required": ["team", "members"]}),
    ("a tree", {"$defs": {"leaf": {"type": "object", "properties": {"value": {"type": "integer", "minimum": 0,
                                                                              "maximum": 9}},
                                   "required": ["value"]}},
                "type": "object", "properties": {"left": {"$ref": "#/$defs/leaf"}, "right": {"$ref": "#/$defs/leaf"}},
                "required": ["left", "right"]}),
    ("a list of tagged items", {"$defs": {"tag": {"type": "string", "enum": ["new", "sale", "old"]}},
                                "type": "array", "maxItems": 3, "items": {
                                    "type": "object", "properties": {"tag": {"$ref": "#/$defs/tag"},
                                                                     "qty": {"type": "integer", "minimum": 1,
                                                                             "maximum": 9}},
                                    "required": ["tag", "qty"]}}),
    ("a nullable note", {"type": "object", "properties": {"note": {"anyOf": [{"type": "string", "maxLength": 30},
                                                                             {"type": "null"}]}},
                         "required": ["note"]}),
    ("a rating", {"type": "object", "properties": {"stars": {"type": "integer", "minimum": 1, "maximum": 5},
                                                   "comment": {"type": "string", "minLength": 1, "maxLength": 50}},
                  "required": ["stars", "comment"]}),
    ("a price", {"type": "object", "properties": {"amount": {"type": "number", "exclusiveMinimum": 0,
                                                             "maximum": 10000},
                                                  "currency": {"type": "string", "enum": ["USD", "EUR", "GBP"]}},
                 "required": ["amount", "currency"]}),
    ("a short word", {"type": "string", "minLength": 2, "maxLength": 8}),
    ("a grid", {"type": "array", "minItems": 2, "maxItems": 2, "items": {
        "type": "array", "minItems": 2, "maxItems": 2, "items": {"type": "integer", "minimum": 0, "maximum": 9}}}),
    ("a config", {"type": "object", "properties": {
        "debug": {"type": "boolean"}, "level": {"type": "string", "enum": ["low", "mid", "high"]},
        "limits": {"type": "object", "properties": {"cpu": {"type": "integer", "minimum": 1, "maximum": 64},
                                                    "mem_gb": {"type": "number", "minimum": 0.5, "maximum": 512}},
                   "required": ["cpu"]}}, "required": ["debug", "level", "limits"]}),
    ("an event", {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 30}, "date": {"type": "string", "pattern": "^2[0-9]{3}-[01][0-9]$"},
        "attendees": {"type": "integer", "minimum": 0, "maximum": 100000}},
        "required": ["name", "date", "attendees"], "additionalProperties": False}),
    ("a status", {"enum": ["ok", 404, None, True]}),
    ("a version string", {"type": "string", "pattern": "^v[0-9]\\.[0-9]{1,2}\\.[0-9]{1,2}$"}),
    ("a matrix entry", {"type": "object", "properties": {"row": {"type": "integer", "minimum": 0, "maximum": 3},
                                                         "col": {"type": "integer", "minimum": 0, "maximum": 3},
                                                         "value": {"type": "number", "minimum": -1, "maximum": 1}},
                        "required": ["row", "col", "value"]}),
    ("a recipe", {"type": "object", "properties": {
        "dish": {"type": "string", "maxLength": 30},
        "steps": {"type": "array", "minItems": 1, "maxItems": 3, "items": {"type": "string", "maxLength": 40}},
        "vegan": {"type": "boolean"}}, "required": ["dish", "steps", "vegan"]}),
]
SEEDS = (1, 2, 3)


@pytest.fixture(scope="module")
def server():
    s = Server(None, "--max-model-len", "2048", "--kv-cache-memory", "768MiB", "--max-num-seqs", "64")
    yield s
    assert s.stop() == 0


def run(coro):
    return asyncio.run(coro)


async def _model(c) -> str:
    return (await c.models.list()).data[0].id


def _messages(what: str) -> list[dict]:
    return [{"role": "user", "content": f"Give me {what} as JSON."}]


async def _collect(stream) -> tuple[str, str]:
    text, reason = "", None
    async for chunk in stream:
        for ch in chunk.choices:
            text += ch.delta.content or ""
            reason = ch.finish_reason or reason
    return text, reason


def test_json_schemas_always_validate_streamed_and_not(server):
    from openai import AsyncOpenAI

    async def one(c, model: str, what: str, schema: dict, seed: int, stream: bool) -> tuple[str, str]:
        kw = dict(model=model, messages=_messages(what), temperature=0.8, seed=seed, max_tokens=400,
                  response_format={"type": "json_schema", "json_schema": {"name": "out", "schema": schema,
                                                                          "strict": True}})
        if stream:
            return await _collect(await c.chat.completions.create(stream=True, **kw))
        r = await c.chat.completions.create(**kw)
        return r.choices[0].message.content, r.choices[0].finish_reason

    async def main() -> list:
        async with AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=600) as c:
            model = await _model(c)
            jobs = [(w, s, seed, st) for w, s in SCHEMAS for seed in SEEDS for st in (False, True)]
            outs = await asyncio.gather(*(one(c, model, *j) for j in jobs))
            return list(zip(jobs, outs))

    assert len(SCHEMAS) >= 30
    results = run(main())
    for (what, schema, seed, stream), (text, reason) in results:
        assert reason == "stop", (what, seed, stream, reason, text)
        jsonschema.validate(json.loads(text), schema)


def test_parse_returns_a_pydantic_object(server):
    from openai import OpenAI

    class City(BaseModel):
        name: str = Field(max_length=40)
        country: str = Field(max_length=40)
        population: int = Field(ge=0)
        landmarks: list[str] = Field(max_length=3)

    c = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    model = c.models.list().data[0].id
    for seed in (1, 2, 3):
        r = c.chat.completions.parse(model=model, messages=_messages("facts about Paris"), response_format=City,
                                     temperature=0.7, seed=seed, max_tokens=400)
        city = r.choices[0].message.parsed
        assert isinstance(city, City) and city.population >= 0, r


def test_regex_choice_grammar_and_json_object(server):
    from openai import AsyncOpenAI

    async def main() -> None:
        async with AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300) as c:
            model = await _model(c)
            msgs = [{"role": "user", "content": "Write a US phone number."}]
            for seed in range(4):
                body = {"structured_outputs": {"regex": r"\(\d{3}\) \d{3}-\d{4}"}}
                r = await c.chat.completions.create(model=model, messages=msgs, temperature=1.0, seed=seed,
                                                    max_tokens=50, extra_body=body)
                assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", r.choices[0].message.content), r
                r = await c.completions.create(model=model, prompt="My favourite animal is", temperature=1.0,
                                               seed=seed, max_tokens=10, n=3,
                                               extra_body={"structured_outputs": {"choice": ["cat", "dog", "a \"bird\""]}})
                assert {ch.text for ch in r.choices} <= {"cat", "dog", 'a "bird"'}, r
                text, reason = await _collect(await c.chat.completions.create(
                    model=model, messages=msgs, temperature=1.0, seed=seed, max_tokens=50, stream=True,
                    extra_body={"structured_outputs": {"grammar": 'root ::= "(" [0-9]{3} ") " [0-9]{3} "-" [0-9]{4}'}}))
                assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", text) and reason == "stop", text
                r = await c.chat.completions.create(model=model, messages=_messages("a small object"), seed=seed,
                                                    temperature=0.7, max_tokens=300,
                                                    response_format={"type": "json_object"})
                if r.choices[0].finish_reason == "stop":  # free-form JSON has no bounds: it may run long
                    assert isinstance(json.loads(r.choices[0].message.content), dict)

    run(main())


TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                       "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "add", "description": "Add two integers",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                                                        "b": {"type": "integer", "minimum": -1000, "maximum": 1000}},
                       "required": ["a", "b"], "additionalProperties": False}}},
]
SCHEMA_OF = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def test_tool_choice_required_and_named_always_yield_valid_calls(server):
    from openai import AsyncOpenAI

    async def one(c, model: str, choice, seed: int, parallel: bool, stream: bool) -> list[tuple[str, str, str]]:
        kw = dict(model=model, messages=[{"role": "user", "content": "What is the weather in Paris, and 2 + 3?"}],
                  tools=TOOLS, tool_choice=choice, parallel_tool_calls=parallel, temperature=0.8, seed=seed,
                  max_tokens=300)
        if not stream:
            r = await c.chat.completions.create(**kw)
            ch = r.choices[0]
            assert ch.finish_reason == "tool_calls" and ch.message.content is None, ch
            return [(t.id, t.function.name, t.function.arguments) for t in ch.message.tool_calls]
        calls: dict[int, list] = {}
        reason = None
        async for chunk in await c.chat.completions.create(stream=True, **kw):
            for ch in chunk.choices:
                assert not ch.delta.content, ch
                for d in ch.delta.tool_calls or []:
                    if d.id:
                        assert d.index not in calls and d.function.name
                        calls[d.index] = [d.id, d.function.name, ""]
                    calls[d.index][2] += d.function.arguments or ""
                reason = ch.finish_reason or reason
        assert reason == "tool_calls"
        return [tuple(calls[i]) for i in sorted(calls)]

    async def main() -> list:
        async with AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300) as c:
            model = await _model(c)
            named = {"type": "function", "function": {"name": "add"}}
            jobs = [(choice, seed, parallel, stream) for choice in ("required", named) for seed in (1, 2, 3)
                    for parallel in (True, False) for stream in (False, True)]
            outs = await asyncio.gather(*(one(c, model, *j) for j in jobs))
            return list(zip(jobs, outs))

    for (choice, seed, parallel, _), calls in run(main()):
        assert calls, (choice, seed)
        if not parallel:
            assert len(calls) == 1
        for cid, name, args in calls:
            assert cid.startswith("call_")
            if isinstance(choice, dict):
                assert name == "add"
            jsonschema.validate(json.loads(args), SCHEMA_OF[name])


def test_tool_results_round_trip_and_auto(server):
    from openai import OpenAI

    c = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    model = c.models.list().data[0].id
    msgs = [{"role": "user", "content": "What is 2 + 3?"}]
    r = c.chat.completions.create(model=model, messages=msgs, tools=TOOLS, tool_choice="required",
                                  parallel_tool_calls=False, temperature=0, max_tokens=200)
    call = r.choices[0].message.tool_calls[0]
    msgs += [r.choices[0].message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": "5"}]
    r = c.chat.completions.create(model=model, messages=msgs, tools=TOOLS, temperature=0, max_tokens=40)
    ch = r.choices[0]
    assert ch.finish_reason in ("stop", "length", "tool_calls")
    for t in ch.message.tool_calls or []:  # auto: any call it makes is a valid one
        jsonschema.validate(json.loads(t.function.arguments), SCHEMA_OF[t.function.name])
    if not ch.message.tool_calls:
        assert ch.message.content
    r = c.chat.completions.create(model=model, messages=msgs[:1], tools=TOOLS, tool_choice="none", max_tokens=8)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content is not None


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "response_format", "objekt"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {"type": "null"}}}}},
     "response_format", "'not'"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "uniqueItems": True}}}}, "response_format", "uniqueItems"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs", "Unclosed"),
    ({"structured_outputs": {"regex": "(?=a)b"}}, "structured_outputs", "Lookahead"),
    ({"structured_outputs": {"grammar": "root ::= missing"}}, "structured_outputs", "missing"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", "choice"),
    ({"structured_outputs": {"choice": ["a"], "regex": "a"}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"jsonn": {}}}, "structured_outputs", "jsonn"),
    ({"structured_outputs": {"regex": "a"}, "guided_choice": ["b"]}, "response_format", "at most one"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tools", "nope"),
    ({"tool_choice": "required"}, "tools", "at least one tool"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools", "twice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools", "bad name!"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"if": {"type": "string"}}}}}}]}, "tools", "'if'"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "cannot be combined"),
]


def test_bad_constraints_are_400_with_the_reason(server):
    msgs = [{"role": "user", "content": "hi"}]
    for extra, param, needle in BAD:
        r = httpx.post(server.url + "/v1/chat/completions", json={"messages": msgs, "max_tokens": 4, **extra}, timeout=60)
        assert r.status_code == 400, (extra, r.text)
        err = r.json()["error"]
        assert needle in err["message"], (extra, err)
        if param != "structured_outputs" or "structured_outputs" in extra:  # pydantic errors carry a location
            assert err["param"] is None or err["param"].startswith(param), (extra, err)
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "tool", "content": "5"}], "max_tokens": 4})
    assert r.status_code == 400 and "tool_call_id" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4, "guided_regex": "[0-9]+"},
                   timeout=60)
    assert r.status_code == 200 and re.fullmatch("[0-9]+", r.json()["choices"][0]["text"])
