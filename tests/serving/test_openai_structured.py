# SPDX-License-Identifier: Apache-2.0
"""Structured outputs at the OpenAI front: each accepted form of response_format, structured_outputs and
the guided_* fields becomes the Triton model's guide type and text; each bad form is a 400 naming its
field (pure functions, no server)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dflash_trt.openai_front import guides
from dflash_trt.openai_front import protocol as P
from dflash_trt.openai_front.upstream import model_error

SERVED = ["tiny"]
SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
GRAMMAR = 'root ::= "yes" | "no"'
TAG = json.dumps({"type": "structural_tag", "format": {"type": "const_string", "value": "hi"}})


def _chat(**body):
    return P.parse_chat({"model": "tiny", "messages": [{"role": "user", "content": "x"}], **body}, SERVED)


def _completions(**body):
    return P.parse_completions({"model": "tiny", "prompt": "x", **body}, SERVED)


ACCEPTED = [  # (body fields, guide type, guide text (None: checked apart), the field errors name)
    ({"response_format": {"type": "json_object"}}, "json_schema", P.ANY_OBJECT, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True,
                                                                 "description": "d"}}},
     "json_schema", json.dumps(SCHEMA), "response_format.json_schema.schema"),
    ({"structured_outputs": {"json": SCHEMA}}, "json_schema", json.dumps(SCHEMA), "structured_outputs.json"),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, "json_schema", json.dumps(SCHEMA),
     "structured_outputs.json"),
    ({"structured_outputs": {"regex": r"\d{3}", "json_object": False}}, "regex", r"\d{3}", "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": GRAMMAR}}, "ebnf_grammar", GRAMMAR, "structured_outputs.grammar"),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, "ebnf_grammar", 'root ::= "yes" | "no"',
     "structured_outputs.choice"),
    ({"structured_outputs": {"json_object": True}}, "json_schema", P.ANY_OBJECT, "structured_outputs.json_object"),
    ({"structured_outputs": {"structural_tag": TAG}}, "structural_tag", TAG, "structured_outputs.structural_tag"),
    ({"guided_json": SCHEMA}, "json_schema", json.dumps(SCHEMA), "guided_json"),
    ({"guided_regex": "a+"}, "regex", "a+", "guided_regex"),
    ({"guided_choice": ["a"]}, "ebnf_grammar", 'root ::= "a"', "guided_choice"),
    ({"guided_grammar": GRAMMAR}, "ebnf_grammar", GRAMMAR, "guided_grammar"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("fields", "kind", "text", "param"), ACCEPTED, ids=[a[3] + ":" + a[1] for a in ACCEPTED]
)
def test_each_form_becomes_the_models_guide_on_both_endpoints(fields, kind, text, param) -> None:
    for gen in (_chat(**fields), _completions(**fields)):
        assert (gen.guide_type, gen.guide, gen.guide_param) == (kind, text, param)


def test_no_guide_and_text_format_send_none() -> None:
    for gen in (
        _chat(),
        _chat(response_format={"type": "text"}),
        _completions(response_format={"type": "text"}),
    ):
        assert (gen.guide_type, gen.guide) == (None, "")


def test_choices_become_a_grammar_of_exactly_those_strings() -> None:
    """Quotes, backslashes, control characters and non-ASCII text are escaped as the EBNF literal needs."""
    testing = pytest.importorskip("xgrammar.testing")
    import xgrammar

    choices = ['say "hi"', "back\\slash", "two\nlines", "tab\t", "bell\x07", "naïve 😀", ""]
    grammar = xgrammar.Grammar.from_ebnf(guides.choice_grammar(choices))
    for choice in choices:
        assert testing._is_grammar_accept_string(grammar, choice), choice
    for other in ['say "hi', 'say \\"hi\\"', "back\\\\slash", "two\\nlines", "naïve", " "]:
        assert not testing._is_grammar_accept_string(grammar, other), other


REFUSED = [  # (body fields, the field the 400 names)
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "json_object", "schema": SCHEMA}}, "response_format.schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}, "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": "{}"}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": "yes"}}},
     "response_format.json_schema.strict"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "x": 1}}},
     "response_format.json_schema.x"),
    ({"structured_outputs": ["json"]}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "grammar": GRAMMAR}}, "structured_outputs"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
    ({"structured_outputs": {"json": [1]}}, "structured_outputs.json"),
    ({"structured_outputs": {"json": "not json"}}, "structured_outputs.json"),
    ({"structured_outputs": {"json": "[1]"}}, "structured_outputs.json"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"choice": ["a", 1]}}, "structured_outputs.choice"),
    ({"structured_outputs": {"regex": ""}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": 3}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs.json_object"),
    ({"guided_choice": "yes"}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"regex": "a"}, "guided_json": SCHEMA}, "guided_json"),
    ({"guided_regex": "a", "guided_grammar": GRAMMAR}, "guided_grammar"),
]  # fmt: skip


@pytest.mark.parametrize(("fields", "param"), REFUSED, ids=[f"{p}-{i}" for i, (_, p) in enumerate(REFUSED)])
def test_bad_forms_are_400s_naming_the_field(fields, param) -> None:
    for parse in (_chat, _completions):
        with pytest.raises(P.OpenAIError) as info:
            parse(**fields)
        err = info.value.body()["error"]
        assert (info.value.status, err["param"]) == (400, param), err
        assert err["message"].startswith(param) and "; fix: " in err["message"] and "\n" not in err["message"]


NOT_COMPILING = [  # (body fields, the field named, words of xgrammar's reason)
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "objet"}}}},
     "response_format.json_schema.schema", 'Unsupported type "objet"'),
    ({"structured_outputs": {"json": {"$ref": "#/nope"}}}, "structured_outputs.json", "nope"),
    ({"structured_outputs": {"regex": "(?<=a)b"}}, "structured_outputs.regex", "Lookbehind"),
    ({"guided_regex": "[a-"}, "guided_regex", "Unclosed"),
    ({"structured_outputs": {"grammar": 'rule ::= "a"'}}, "structured_outputs.grammar", "root"),
    ({"guided_grammar": 'root ::= "a" |'}, "guided_grammar", "EBNF parser error"),
    ({"structured_outputs": {"structural_tag": '{"type": "nope"}'}}, "structured_outputs.structural_tag", ""),
]  # fmt: skip


@pytest.mark.parametrize(("fields", "param", "words"), NOT_COMPILING, ids=[n[1] for n in NOT_COMPILING])
def test_a_guide_xgrammar_cannot_compile_is_a_400_with_its_reason(fields, param, words) -> None:
    pytest.importorskip("xgrammar")
    with pytest.raises(P.OpenAIError) as info:
        _chat(**fields)
    err = info.value.body()["error"]
    assert err["param"] == param and f"{param}=" in err["message"], err
    assert (
        "does not compile: " in err["message"] and words in err["message"] and "fix: send" in err["message"]
    )
    assert "\n" not in err["message"] and ".cc:" not in err["message"]  # one line, no C++ source location


def test_without_xgrammar_the_engine_alone_judges_the_guide(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar raises ImportError
    assert guides.compile_error("regex", "[a-") is None
    assert _chat(guided_regex="[a-").guide == "[a-"


def test_the_engines_guide_refusal_names_the_clients_field() -> None:
    gen = _chat(structured_outputs={"regex": "a+"})
    for field in ("guided_decoding", "guided_decoding_guide", "guided_decoding_guide_type"):
        err = model_error(f"guided_decoding: does not compile (error: INVALID_ARG, field: {field})", gen)
        assert (err.status, err.param) == (400, "structured_outputs.regex")


def test_the_front_imports_xgrammar_only_to_compile_a_guide() -> None:
    pytest.importorskip("xgrammar")
    code = (
        "import sys, dflash_trt\n"
        "from dflash_trt.openai_front import app, protocol as P\n"
        "chat = {'model': 't', 'messages': [{'role': 'user', 'content': 'x'}]}\n"
        "P.parse_chat({**chat, 'response_format': {'type': 'json_object'}}, ['t'])\n"  # nothing to compile
        "print('xgrammar' in sys.modules)\n"
        "P.parse_chat({**chat, 'guided_regex': 'a+'}, ['t'])\n"
        "print('xgrammar' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True"], out.stdout + out.stderr
