"""Structured outputs in the engine: grammars compile once, masks hold under n > 1, preemption,
stop strings, min_tokens and every KV / weight dtype; bad specs are refused with the reason."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from pagedllm import LLM, InvalidRequestError, SamplingParams, StructuredOutputsParams
from pagedllm.entrypoints.openai.tool_calls import HERMES, LLAMA3_JSON, structural_tag
from pagedllm.sample.structured_outputs import INT64, bound_integers, check_json_schema

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "pets": {"type": "array", "maxItems": 2,
                                                    "items": {"type": "string", "enum": ["cat", "dog"]}}},
          "required": ["name", "age", "pets"]}


def test_params_need_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one.*regex, choice"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=["a", ""])
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutputsParams(json="{nope")
    with pytest.raises(ValueError, match="unknown field 'jsn'"):
        SamplingParams(structured_outputs={"jsn": {}})
    p = SamplingParams(structured_outputs={"json": {"b": 1, "a": 2}})
    assert p.structured_outputs.key == ("json", '{"b": 1, "a": 2}')  # key order is output order: kept
    assert p.clone_for_child(1).structured_outputs is p.structured_outputs


def test_schema_checks_name_what_the_grammar_cannot_enforce():
    check_json_schema(PERSON)
    for schema, kw in [({"not": {"type": "null"}}, "not"), ({"type": "array", "uniqueItems": True}, "uniqueItems"),
                       ({"properties": {"a": {"if": {}, "then": {}}}}, "if"),
                       ({"anyOf": [{"type": "object", "dependentRequired": {}}]}, "dependentRequired"),
                       ({"items": {"contains": {"type": "integer"}}}, "contains"),
                       ({"allOf": [{"type": "object"}, {"required": ["a"]}]}, "allOf")]:
        with pytest.raises(InvalidRequestError, match=f"'{kw}'"):
            check_json_schema(schema)


def test_bound_integers_gives_unbounded_integers_int64_range():
    s = bound_integers({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer", "minimum": 3},
                                                         "c": {"type": "integer", "exclusiveMaximum": 9},
                                                         "d": {"type": "number"}, "e": {"enum": [{"type": "integer"}]}}})
    p = s["properties"]
    assert (p["a"]["minimum"], p["a"]["maximum"]) == INT64
    assert (p["b"]["minimum"], p["b"]["maximum"]) == (3, INT64[1])
    assert "maximum" not in p["c"] and p["c"]["minimum"] == INT64[0]
    assert p["d"] == {"type": "number"} and p["e"] == {"enum": [{"type": "integer"}]}


def test_default_model_outputs_validate_for_every_kind(smollm):
    msgs = [{"role": "user", "content": "Describe a person as JSON."}]
    cases = [({"json": PERSON}, lambda t: jsonschema.validate(json.loads(t), PERSON)),
             ({"regex": r"[A-Z][a-z]{2,8} [0-9]{1,3}"}, lambda t: re.fullmatch(r"[A-Z][a-z]{2,8} [0-9]{1,3}", t) or 1 / 0),
             ({"choice": ["yes", "no", "it's \"complicated\""]},
              lambda t: t in ("yes", "no", 'it\'s "complicated"') or 1 / 0),
             ({"grammar": 'root ::= "A" [0-9] [0-9]? "!"'}, lambda t: re.fullmatch(r"A[0-9]{1,2}!", t) or 1 / 0)]
    for so, check in cases:
        out = smollm.chat(msgs, SamplingParams(temperature=0.9, seed=7, n=3, max_tokens=200, structured_outputs=so))
        for c in out[0].outputs:
            assert c.finish_reason == "stop", (so, c)
            check(c.text)
            assert c.token_ids[-1] in smollm.engine.eos_token_ids  # it ended where the grammar may end


def test_special_tokens_are_never_allowed_inside_an_output(smollm):
    e = smollm.engine
    compiled = e.compile_grammar(StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "string"}},
                                                               "required": ["a"]}))
    m = e.structured.matcher(compiled)
    for t in e.tokenizer.encode('{"a": "x', add_special_tokens=False):
        assert m.accept_token(t)
    logits = torch.zeros(1, e.model_config.vocab_size)
    e.structured.apply_masks(logits, [0], [m])
    allowed = set(torch.isfinite(logits[0]).nonzero().flatten().tolist())
    specials = {i for i, t in e.tokenizer.tok.get_added_tokens_decoder().items() if t.special}
    assert specials and not allowed & specials  # <|im_end|> and friends are no string characters
    assert len(allowed) > 40000  # but nearly everything else is


def test_compile_is_cached_and_errors_carry_the_compilers_message(smollm):
    e = smollm.engine
    spec = StructuredOutputsParams(regex="[0-9]{4}-cached")
    before = e.structured.stats.num_compiles
    a, b = e.compile_grammar(spec), e.compile_grammar(StructuredOutputsParams(regex="[0-9]{4}-cached"))
    assert a is b and e.structured.stats.num_compiles == before + 1
    for bad, needle in [(StructuredOutputsParams(regex="[a-"), "Unclosed"),
                        (StructuredOutputsParams(grammar="root ::= nope"), "nope"),
                        (StructuredOutputsParams(json={"type": "strin"}), "strin"),
                        (StructuredOutputsParams(json={"type": "array", "uniqueItems": True}), "uniqueItems"),
                        (StructuredOutputsParams(structural_tag={"type": "structural_tag", "format": {"type": "x"}}),
                         "structural_tag")]:
        with pytest.raises(InvalidRequestError, match=needle):
            smollm.generate("hi", SamplingParams(max_tokens=4, structured_outputs=bad))
    assert not e.has_unfinished_requests()


def test_grammar_wins_over_min_tokens_and_stop_strings_cut_it(smollm):
    out = smollm.generate("Answer:", SamplingParams(temperature=0.8, seed=1, max_tokens=20, min_tokens=6,
                                                    structured_outputs={"choice": ["yes", "no"]}))
    assert out[0].outputs[0].text in ("yes", "no") and out[0].outputs[0].finish_reason == "stop"
    out = smollm.generate("Code:", SamplingParams(temperature=0, max_tokens=20, stop=["-"],
                                                  structured_outputs={"regex": "[a-z]{3}-[0-9]{3}"}))
    assert re.fullmatch("[a-z]{3}", out[0].outputs[0].text) and out[0].outputs[0].stop_reason == "-"


def test_tool_structural_tags_compile_and_constrain(smollm):
    tools = [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}]
    for fmt in (HERMES, LLAMA3_JSON):
        tag = structural_tag(fmt, tools, "required", parallel=False)
        out = smollm.chat([{"role": "user", "content": "2+3?"}],
                          SamplingParams(temperature=0.8, seed=3, max_tokens=120,
                                         structured_outputs={"structural_tag": tag}))
        text = out[0].outputs[0].text
        assert text.startswith(fmt.begin("add")) and text.endswith(fmt.end), text
        args = json.loads(text[len(fmt.begin("add")):len(text) - len(fmt.end)])
        assert set(args) == {"a", "b"} and all(abs(v) < 2**63 for v in args.values())


@pytest.mark.parametrize("options", [dict(num_kv_blocks=12, block_size=16),  # preempts
                                     dict(kv_cache_dtype="fp8_e4m3"), dict(dtype="bfloat16")])
def test_tiny_model_grammar_holds_under_preemption_and_dtypes(chat_model_dir, options):
    llm = LLM(chat_model_dir, max_num_seqs=8, **options)
    pattern = r"(ab|cd){10}[0-9]{5}"
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=40, n=1 + i % 2,
                             structured_outputs={"regex": pattern}) for i in range(8)]
    outs = llm.generate([f"prompt number {i} " * 6 for i in range(8)], params)
    for o in outs:
        for c in o.outputs:
            assert re.fullmatch(pattern, c.text) and c.finish_reason == "stop", c
    if "num_kv_blocks" in options:
        assert llm.stats().num_preemptions > 0
