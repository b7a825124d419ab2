"""Structured output (decodekit/plugins/structured.py): JSON schemas, regexes, grammars and choices on the
default model with every strategy that keeps them, row state under reordering and rollback, the compiled
step, cut-off rows and bad input."""

import json
import logging
import re

import pytest
import torch

pytest.importorskip("llguidance", reason="structured output needs the decodekit[structured] extra (make install-dev)")
jsonschema = pytest.importorskip("jsonschema", reason="validating outputs needs jsonschema (decodekit[structured])")

from decodekit.plugins import structured  # noqa: E402  (after the importorskip)


def strict(properties: dict, required=None) -> dict:
    return {
        "type": "object",
        "properties": properties,
        "required": list(required if required is not None else properties),
        "additionalProperties": False,
    }


NAME = {"type": "string", "maxLength": 16}
SCHEMAS = [
    ("a person", strict({"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}})),
    (
        "a person and their address",
        strict({"name": NAME, "address": strict({"city": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}})}),
    ),
    ("two or three colours", strict({"colors": {"type": "array", "items": NAME, "minItems": 2, "maxItems": 3}})),
    ("a mood", strict({"mood": {"enum": ["happy", "sad", "angry"]}})),
    ("a temperature in Celsius", strict({"celsius": {"type": "number", "minimum": -50, "maximum": 60}})),
    ("a book title, maybe a subtitle", strict({"title": NAME, "subtitle": NAME}, required=["title"])),
    ("a flight code", strict({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}})),
    ("a task", strict({"done": {"type": "boolean"}, "count": {"type": "integer", "minimum": 0, "maximum": 10}})),
    (
        "a shopping list",
        strict(
            {
                "items": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 2,
                    "items": strict({"name": NAME, "qty": {"type": "integer", "minimum": 1, "maximum": 9}}),
                }
            }
        ),
    ),
    (
        "three scores",
        {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100}, "minItems": 3, "maxItems": 3},
    ),
    ("a version record", strict({"version": {"const": "1.0"}, "ok": {"type": "boolean"}})),
    ("a value", strict({"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 999}, NAME]}})),
    ("a middle name or none", strict({"middle_name": {"type": ["string", "null"], "maxLength": 10}})),
    ("a price", strict({"price": {"type": "number", "exclusiveMinimum": 0, "maximum": 1000}})),
    (
        "a company and its CEO",
        strict(
            {
                "company": strict(
                    {
                        "name": NAME,
                        "ceo": strict({"name": NAME, "age": {"type": "integer", "minimum": 18, "maximum": 99}}),
                    }
                )
            }
        ),
    ),
    ("a rating", strict({"rating": {"enum": [1, 2, 3, 4, 5]}})),
    ("a date", strict({"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}})),
    (
        "a line segment",
        {
            "$defs": {
                "point": strict(
                    {
                        "x": {"type": "integer", "minimum": -9, "maximum": 9},
                        "y": {"type": "integer", "minimum": -9, "maximum": 9},
                    }
                )
            },
            **strict({"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}}),
        },
    ),
    ("a word", strict({"word": {"type": "string", "minLength": 3, "maxLength": 8}})),
    ("some tags", strict({"tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 2}})),
]


def chat(tok, request: str) -> torch.Tensor:
    return tok.apply_chat_template(
        [{"role": "user", "content": f"Reply with JSON for {request}."}],
        add_generation_prompt=True,
        return_tensors="pt",
    )


def text_of(tok, out, prompt) -> str:
    return tok.decode(out[0, prompt.shape[1] :], skip_special_tokens=True)


@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampling"])
def test_twenty_schemas_give_json_that_validates(default_model, sample):
    model, tok = default_model
    for index, (request, schema) in enumerate(SCHEMAS):
        prompt = chat(tok, request)
        extra = {"do_sample": True, "top_p": 0.95, "seed": index} if sample else {}
        out = model.generate(prompt, json_schema=schema, tokenizer=tok, max_new_tokens=160, **extra)
        text = text_of(tok, out, prompt)
        jsonschema.validate(json.loads(text), schema)  # raises with the reason if it does not


def test_regexes_match_whole_and_choices_are_one_of_them(default_model):
    model, tok = default_model
    for pattern in (
        r"[A-Z][a-z]{2,9} is [0-9]{1,2} years old\.",
        r"(yes|no), because [a-z ]{5,30}\.",
        r"[0-9]{3}-[0-9]{4}",
    ):
        prompt = chat(tok, "anything")
        assert re.fullmatch(
            pattern, text_of(tok, model.generate(prompt, regex=pattern, tokenizer=tok, max_new_tokens=40), prompt)
        )
    choices = ["Paris", "London", "a city I do not know"]
    prompt = chat(tok, "the capital of France")
    for extra in ({}, {"do_sample": True, "seed": 1}, {"do_sample": True, "seed": 2, "top_k": 3}):
        out = model.generate(prompt, choice=choices, tokenizer=tok, max_new_tokens=20, **extra)
        assert text_of(tok, out, prompt) in choices
    grammar = 'start: "The answer is " NUMBER "."\nNUMBER: /[0-9]{1,4}/'
    out = model.generate(prompt, grammar=grammar, tokenizer=tok, max_new_tokens=20)
    assert re.fullmatch(r"The answer is [0-9]{1,4}\.", text_of(tok, out, prompt))


@pytest.mark.parametrize(
    "strategy",
    [{"num_beams": 3}, {"prompt_lookup_num_tokens": 4}, {"assistant_early_exit": 10}],
    ids=["beam-search", "prompt-lookup", "self-speculative"],
)
def test_strategies_that_reorder_or_roll_back_rows_keep_the_constraint(default_model, strategy):
    model, tok = default_model
    cases = (
        (SCHEMAS[1], SCHEMAS[8], SCHEMAS[17]) if "assistant_early_exit" not in strategy else (SCHEMAS[8],)
    )  # 0.4x: one
    for request, schema in cases:
        prompt = chat(tok, request)
        out = model.generate(prompt, json_schema=schema, tokenizer=tok, max_new_tokens=120, **strategy)
        jsonschema.validate(json.loads(text_of(tok, out, prompt)), schema)


def test_each_row_follows_its_tokens_through_reordering_and_rollback(default_model):
    # The processor keeps one matcher per row of its last call and finds a row's by its tokens. After the
    # rows are reordered and copied (beam search) or cut back (rejected speculative tokens), its masks must
    # be those a fresh processor computes from the same rows.
    model, tok = default_model
    vocab = model.config.vocab_size
    eos = (tok.eos_token_id,)
    template = structured.compiled(
        structured.llg_tokenizer(tok, vocab, eos),
        structured.require_engine().grammar_from("choice", ["red apple", "green pear", "blue sky"]),
    )
    red, green = tok.encode("red apple"), tok.encode("green pear")
    assert len(red) == len(green) == 2
    prompt, end = [7, 8], eos[0]

    def rows(*tokens_lists):
        return torch.tensor([prompt + tokens for tokens in tokens_lists])

    def fresh(ids):
        return structured.GrammarLogitsProcessor(template, len(prompt), vocab, eos).step_mask(ids)

    tracked = structured.GrammarLogitsProcessor(template, len(prompt), vocab, eos)
    calls = [
        rows(red[:1], green[:1]),
        rows(green, red, red),  # reordered, one row copied (beam search)
        rows(red[:1]),  # cut back (rejected speculative tokens)
        rows(red + [end], green + [end]),
        rows(red + [end, end], green + [end, end]),
    ]  # ended, then padding
    for ids in calls:
        assert torch.equal(tracked.step_mask(ids), fresh(ids))
    allowed = fresh(rows(red))[0]
    assert allowed.sum() == 1 and allowed[eos[0]]  # a finished choice may only end


@pytest.mark.parametrize("strategy", [{}, {"num_beams": 3}], ids=["greedy", "beam-search"])
def test_the_compiled_step_keeps_the_constraint_and_stays_compiled(default_model, caplog, strategy):
    model, tok = default_model
    request, schema = SCHEMAS[0]
    prompt = chat(tok, request)
    eager = model.generate(prompt, json_schema=schema, tokenizer=tok, max_new_tokens=60, **strategy)
    with caplog.at_level(logging.INFO, logger="decodekit"):
        compiled = model.generate(
            prompt, json_schema=schema, tokenizer=tok, max_new_tokens=60, compile=True, **strategy
        )
    assert "falls back to the eager loop" not in caplog.text
    assert torch.equal(compiled, eager)
    jsonschema.validate(json.loads(text_of(tok, compiled, prompt)), schema)


def test_a_row_cut_off_before_the_end_is_reported(default_model, caplog):
    model, tok = default_model
    request, schema = SCHEMAS[1]
    prompt = chat(tok, request)
    with caplog.at_level(logging.WARNING, logger="decodekit"):
        out = model.generate(prompt, json_schema=schema, tokenizer=tok, max_new_tokens=4, return_dict_in_generate=True)
    assert out.constraint_complete.tolist() == [False] and out.sequences.shape[1] == prompt.shape[1] + 4
    assert "1 of 1 rows ended before the json_schema allowed an end" in caplog.text
    whole = model.generate(prompt, json_schema=schema, tokenizer=tok, max_new_tokens=120, return_dict_in_generate=True)
    assert whole.constraint_complete.tolist() == [True]


def test_response_format_and_pydantic_models(default_model):
    pydantic = pytest.importorskip("pydantic")
    model, tok = default_model

    class City(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")  # additionalProperties: false
        name: str = pydantic.Field(max_length=16)
        population: int = pydantic.Field(ge=0, le=50_000_000)

    prompt = chat(tok, "a large city")
    out = model.generate(prompt, json_schema=City, tokenizer=tok, max_new_tokens=80)
    City.model_validate_json(text_of(tok, out, prompt))
    format_ = {"type": "json_schema", "json_schema": {"name": "city", "schema": City.model_json_schema()}}
    out = model.generate(prompt, response_format=format_, tokenizer=tok, max_new_tokens=80)
    City.model_validate_json(text_of(tok, out, prompt))
    point = chat(tok, "a point with x and y")
    out = model.generate(point, response_format={"type": "json_object"}, tokenizer=tok, max_new_tokens=120)
    assert isinstance(json.loads(text_of(tok, out, point)), dict)
    plain = model.generate(prompt, max_new_tokens=8)
    assert torch.equal(model.generate(prompt, response_format={"type": "text"}, tokenizer=tok, max_new_tokens=8), plain)


def test_a_transformers_model_through_wrap_keeps_the_constraint(default_model):
    # A random transformers model: whatever it would say, the output must match.
    transformers = pytest.importorskip("transformers")
    import decodekit

    _, tok = default_model
    config = transformers.LlamaConfig(
        vocab_size=49152,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(0)
    model = decodekit.wrap(transformers.LlamaForCausalLM(config).eval())
    prompt = torch.tensor([[1, 2, 3]])
    pattern = r"[a-z]{3,8}@[a-z]{2,5}\.(com|org)"
    for extra in ({}, {"do_sample": True, "seed": 0}):
        out = model.generate(prompt, regex=pattern, tokenizer=tok, max_new_tokens=30, **extra)
        assert re.fullmatch(pattern, tok.decode(out[0, 3:], skip_special_tokens=True))
    out = model.generate(prompt, choice=["alpha", "beta"], tokenizer=tok, max_new_tokens=10, num_beams=2)
    assert tok.decode(out[0, 3:], skip_special_tokens=True) in ("alpha", "beta")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"json_schema": {"type": "objekt"}}, "json_schema={'type': 'objekt'} is invalid; not a valid JSON schema"),
        ({"json_schema": "{not json"}, "json_schema='{not json' is invalid; not JSON"),
        ({"json_schema": 42}, "expected a JSON schema: a dict, its JSON text, or a pydantic model class"),
        ({"regex": "[a-"}, "regex='[a-' is invalid; the grammar engine says"),
        ({"regex": ""}, "expected a regular expression (a non-empty string)"),
        ({"grammar": "start: undefined_rule"}, "grammar='start: undefined_rule' is invalid"),
        ({"choice": []}, "choice=[] is invalid; expected a non-empty list of non-empty strings"),
        ({"choice": ["a", 3]}, "expected a non-empty list of non-empty strings"),
        (
            {"response_format": {"type": "xml"}},
            "expected a dict whose 'type' is one of ['text', 'json_object', 'json_schema']",
        ),
        ({"response_format": {"type": "json_schema"}}, "type 'json_schema' needs {'json_schema': {'schema': {...}}}"),
        ({"regex": "a", "choice": ["a"]}, "structured output takes one constraint at a time; got regex and choice"),
        # No finite value matches these: the engine's grammar only ended at once, and the call gave empty text.
        ({"json_schema": {"$ref": "#"}}, "the schema admits no finite JSON value"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {
                            "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                            "$ref": "#/$defs/a",
                        },
                    },
                }
            },
            "the schema admits no finite JSON value",
        ),
        (
            {"json_schema": {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}},
            "the schema admits no finite JSON value",
        ),
    ],
    ids=[
        "bad-schema",
        "not-json",
        "not-a-schema",
        "bad-regex",
        "empty-regex",
        "bad-grammar",
        "no-choices",
        "choice-type",
        "format-type",
        "format-schema",
        "two-constraints",
        "self-reference",
        "reference-cycle",
        "required-self",
    ],
)
def test_bad_constraints_are_clear_errors(default_model, kwargs, message):
    model, tok = default_model
    with pytest.raises(ValueError) as error:
        model.generate(torch.tensor([[1, 2]]), tokenizer=tok, max_new_tokens=2, **kwargs)
    assert message in str(error.value)


def test_a_constraint_needs_the_tokenizer(default_model):
    model, _ = default_model
    with pytest.raises(
        ValueError, match=r"regex= needs the model's tokenizer to compile the constraint: pass tokenizer="
    ):
        model.generate(torch.tensor([[1, 2]]), regex="a+", max_new_tokens=2)


def test_the_command_line_takes_schema_files_and_choices(default_model, tmp_path, capsys):
    from decodekit.cli import main

    schema = tmp_path / "city.json"
    schema.write_text(json.dumps(strict({"city": NAME})))
    assert (
        main(
            [
                "generate",
                "Name a city.",
                "--chat",
                "--json-schema",
                str(schema),
                "--max-new-tokens",
                "40",
                "--no-stream",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out.strip()
    assert set(json.loads(out)) == {"city"}
    assert main(["generate", "Is water wet?", "--chat", "--choice", "yes", "--choice", "no", "--no-stream"]) == 0
    assert capsys.readouterr().out.strip() in ("yes", "no")
    assert main(["generate", "Hi", "--json-schema", str(tmp_path / "missing.json")]) == 2
    assert f"--json-schema {tmp_path / 'missing.json'}: cannot read the file" in capsys.readouterr().err
    assert main(["generate", "Hi", "--regex", "[a-"]) == 2
    assert "generation config: --regex '[a-' is invalid" in capsys.readouterr().err


def test_the_kept_tokenizer_views_and_grammars_stay_within_their_bounds(default_model, monkeypatch):
    # Distinct stop token sets each make a tokenizer view, and the grammars compiled against a view kept it alive:
    # the views a request could make were bounded only by the grammars' count (server RSS 3.6 -> 5.4 GB). Now a view
    # that goes takes its grammars, and grammars are bounded by their text's size too.
    _, tok = default_model
    monkeypatch.setattr(structured, "_tokenizers", type(structured._tokenizers)())
    monkeypatch.setattr(structured, "_grammars", type(structured._grammars)())
    monkeypatch.setattr(structured, "KEEP_GRAMMAR_CHARS", 3000)
    vocab = len(tok)
    for stop in range(8):
        view = structured.llg_tokenizer(tok, vocab, (stop,))
        structured.compiled(view, structured.require_engine().LLMatcher.grammar_from_json_schema(strict({"a": NAME})))
        assert len(structured._tokenizers) <= structured.KEEP_TOKENIZERS
        alive = {id(view) for _, view in structured._tokenizers.values()}
        assert all(key[0] in alive for key in structured._grammars)  # no grammar outlives its view
    view = structured.llg_tokenizer(tok, vocab, ())
    for size in range(1, 40):  # grammars of growing text: the total stays under the bound (one may exceed it alone)
        schema = strict({f"field_{i}": NAME for i in range(size)})
        structured.compiled(view, structured.require_engine().LLMatcher.grammar_from_json_schema(schema))
        kept = [len(grammar) for _, grammar in structured._grammars]
        assert len(kept) == 1 or sum(kept) <= 3000


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}, "required": ["kids"]},
        {"anyOf": [{"$ref": "#"}, {"type": "string"}]},
        {"type": "object", "properties": {"next": {"anyOf": [{"type": "null"}, {"$ref": "#"}]}}, "required": ["next"]},
    ],
    ids=["tree", "self-or-string", "linked-list"],
)
def test_recursive_schemas_with_a_way_out_are_served(default_model, schema):
    model, tok = default_model
    out = model.generate(torch.tensor([[1, 2]]), tokenizer=tok, max_new_tokens=24, json_schema=schema)
    assert out.shape[1] > 2  # generated, under the constraint (a tree's JSON may be cut off at 24 tokens)
