"""Structured output: JSON that matches a schema, text that matches a regex or a grammar, one of a few choices.

Fields (one at a time):
    json_schema      a JSON schema as a dict or JSON text, or a pydantic model class
    regex            a regular expression the whole output must match
    grammar          a grammar in Lark syntax or llama.cpp's GBNF
    choice           a list of strings; the output is one of them
    response_format  OpenAI's form: {"type": "text" | "json_object"} or
                     {"type": "json_schema", "json_schema": {"schema": {...}, ...}}

Built on llguidance (the decodekit[structured] extra; docs/structured-output.md says why that engine). The
constraint is compiled against the tokenizer once per (tokenizer, vocabulary size, constraint) and kept;
each row of a call gets its own matcher, which gives the tokens allowed next as a bitmask. The processor
runs first among the processors (after guidance), so top-k, top-p and the rest choose among allowed tokens.

Rows are followed by their tokens, not their index: a row's matcher is the one whose tokens are the longest
prefix of the row's, so beam search (rows reordered and copied), assisted decoding and prompt lookup
(rejected tokens rolled back) keep each row's state without telling the processor anything. A row that
ends before the grammar allows it (max_new_tokens reached) keeps its partial output; generate() logs a
warning and, with return_dict_in_generate=True, sets `constraint_complete` [rows] on the output.
"""

from __future__ import annotations

import json
import logging
import math
import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass

import torch

from ..core.tokens import common_prefix
from ..registry import hookimpl
from ..core.processors import Processor

logger = logging.getLogger("decodekit")

FIELDS = ("json_schema", "regex", "grammar", "choice", "response_format")
EXTRA = "pip install 'decodekit[structured]'"
RESPONSE_TYPES = ("text", "json_object", "json_schema")


@hookimpl
def decodekit_config_fields():
    return dict.fromkeys(FIELDS)


@hookimpl
def decodekit_validate_config(generation_config, context):
    gc = generation_config
    given = [name for name in FIELDS if getattr(gc, name) is not None]
    if not given:
        return
    if len(given) > 1:
        raise ValueError(f"structured output takes one constraint at a time; got {' and '.join(given)}.")
    field = given[0]
    grammar = grammar_for(gc, field)
    if grammar is None:  # response_format={"type": "text"}
        return
    if context.tokenizer is None:
        if context.model is None:
            return  # checked before loading: the grammar is compiled with the tokenizer at the call
        raise ValueError(
            f"{field}= needs the model's tokenizer to compile the constraint: pass tokenizer= to generate()."
        )
    try:  # compiled now, into the cache the processor then takes it from
        compiled(llg_tokenizer(context.tokenizer, vocab_size(context), eos_ids(gc)), grammar)
    except GrammarError as error:
        raise gc.invalid(field, f"the grammar engine says: {str(error).strip()}") from None


@hookimpl
def decodekit_logits_processors(generation_config, context):
    gc = generation_config
    field = next((name for name in FIELDS if getattr(gc, name) is not None), None)
    grammar = grammar_for(gc, field) if field is not None else None
    if grammar is None:
        return []
    template = compiled(llg_tokenizer(context.tokenizer, vocab_size(context), eos_ids(gc)), grammar)
    return [GrammarLogitsProcessor(template, context.prompt_length, vocab_size(context), eos_ids(gc), field)]


def require_engine(field: str = "structured output"):
    try:
        import llguidance
    except ImportError:
        raise ImportError(f"{field}= needs the grammar engine llguidance: {EXTRA}") from None
    return llguidance


def eos_ids(gc) -> tuple[int, ...]:
    """The tokens that end a row: the grammar allows them where it may end, and only them once it must."""
    return tuple(gc.eos_token_ids or ())


def vocab_size(context) -> int:
    config = getattr(context.model, "config", None)
    size = getattr(config, "vocab_size", None) or getattr(getattr(config, "text_config", None), "vocab_size", None)
    if not size:
        raise ValueError("structured output needs the model's vocabulary size (config.vocab_size).")
    return int(size)


# ---- the constraint as a grammar -------------------------------------------------------------------------


def grammar_for(gc, field: str) -> str | None:
    """llguidance's grammar for the constraint in `field`, or None for response_format={"type": "text"};
    a value of the wrong kind is a ValueError naming the field and what it accepts."""
    value = getattr(gc, field)
    if field == "response_format":
        schema = _response_schema(gc, value)
        return None if schema is None else _from_schema(gc, field, schema)
    engine = require_engine(field)
    if field == "json_schema":
        return _from_schema(gc, field, _schema_dict(gc, value))
    if field == "regex":
        if not isinstance(value, str) or not value:
            raise gc.invalid(field, "expected a regular expression (a non-empty string)")
        return engine.LLMatcher.grammar_from_regex(value)
    if field == "grammar":
        if not isinstance(value, str) or not value.strip():
            raise gc.invalid(field, "expected a grammar in Lark syntax or GBNF (a non-empty string)")
        try:
            return engine.grammar_from("grammar", value)
        except ValueError as error:
            raise gc.invalid(field, str(error)) from None
    if not isinstance(value, (list, tuple)) or not value or not all(isinstance(c, str) and c for c in value):
        raise gc.invalid(field, "expected a non-empty list of non-empty strings")
    return engine.grammar_from("choice", list(value))


def _response_schema(gc, value) -> dict | None:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in RESPONSE_TYPES:
        raise gc.invalid("response_format", f"expected a dict whose 'type' is one of {list(RESPONSE_TYPES)}")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    inner = value.get("json_schema")
    schema = inner.get("schema") if isinstance(inner, dict) else None
    if schema is None:
        raise gc.invalid("response_format", "type 'json_schema' needs {'json_schema': {'schema': {...}}}")
    return _schema_dict(gc, schema, "response_format")


def _schema_dict(gc, value, field: str = "json_schema") -> dict:
    if isinstance(value, type) and hasattr(value, "model_json_schema"):  # a pydantic model class
        return value.model_json_schema()
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as error:
            raise gc.invalid(field, f"not JSON ({error})") from None
    if not isinstance(value, dict):
        raise gc.invalid(field, "expected a JSON schema: a dict, its JSON text, or a pydantic model class")
    try:
        import jsonschema
    except ImportError:
        return value  # the engine still refuses what it cannot compile
    try:
        jsonschema.validators.validator_for(value).check_schema(value)
    except jsonschema.SchemaError as error:
        raise gc.invalid(field, f"not a valid JSON schema: {error.message}") from None
    if not admits_a_value(value):
        raise gc.invalid(
            field,
            "the schema admits no finite JSON value: a $ref that refers back to itself with "
            "nothing else to choose (every value would nest forever), or false",
        )
    return value


def _subschemas(schema) -> list[dict]:
    """Every dict inside `schema`, itself included, once each; iteratively (a schema may nest deeply)."""
    nodes, stack, seen = [], [schema], set()
    while stack:
        node = stack.pop()
        if isinstance(node, dict) and id(node) not in seen:
            seen.add(id(node))
            nodes.append(node)
            stack.extend(v for v in node.values() if isinstance(v, (dict, list)))
        elif isinstance(node, list):
            stack.extend(v for v in node if isinstance(v, (dict, list)))
    return nodes


def _referenced(schema, ref):
    """What the local reference `ref` ("#/$defs/x") points at inside `schema`; True (taken to admit a value) for a
    reference into another document or one that leads nowhere (the engine reports that itself)."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        return True
    target = schema
    for part in [p for p in ref[1:].split("/") if p]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(target, dict) and part in target:
            target = target[part]
        elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
            target = target[int(part)]
        else:
            return True
    return target


def admits_a_value(schema) -> bool:
    """Whether some finite JSON value could match `schema`, as far as its structure tells (`false`, and required
    properties, array items and references that can only lead back to themselves, cannot; keywords it does not
    weigh are taken to allow a value). The engine compiles `{"$ref": "#"}` to a grammar that only ends at once: the
    call then gave empty text, never an error. A least fixed point over the schema's subschemas: none admits a value
    until what it needs does."""
    nodes = _subschemas(schema)
    admits: dict[int, bool] = {id(n): False for n in nodes}

    def value(sub) -> bool:
        return sub if isinstance(sub, bool) else admits.get(id(sub), True) if isinstance(sub, dict) else True

    def resolve(ref):
        return _referenced(schema, ref)

    def admitted(node: dict) -> bool:
        if "$ref" in node and not value(resolve(node["$ref"])):
            return False
        if "anyOf" in node and not any(value(s) for s in node["anyOf"]):
            return False
        if "oneOf" in node and not any(value(s) for s in node["oneOf"]):
            return False
        if "allOf" in node and not all(value(s) for s in node["allOf"]):
            return False
        if "enum" in node or "const" in node:
            return True
        kinds = node.get("type")
        kinds = set(kinds) if isinstance(kinds, list) else {kinds} if kinds else set()
        if kinds - {"object", "array"}:
            return True  # a string, number, boolean or null is always there to take
        properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        if ("object" in kinds or not kinds) and not all(
            value(properties[r]) for r in node.get("required", []) if isinstance(r, str) and r in properties
        ):
            return "array" in kinds and array_admitted(node)
        return "array" not in kinds or array_admitted(node) or "object" in kinds

    def array_admitted(node: dict) -> bool:
        least = node.get("minItems", 0)
        if not isinstance(least, int) or least < 1:
            return True
        prefix = node.get("prefixItems") if isinstance(node.get("prefixItems"), list) else []
        needed = prefix[:least] + ([node["items"]] if "items" in node and len(prefix) < least else [])
        return all(value(s) for s in needed)

    changed = True
    while changed:
        changed = False
        for node in nodes:
            if not admits[id(node)] and admitted(node):
                admits[id(node)] = changed = True
    return value(schema)


def _from_schema(gc, field: str, schema: dict) -> str:
    engine = require_engine(field)
    try:
        return engine.LLMatcher.grammar_from_json_schema(schema)
    except ValueError as error:
        raise gc.invalid(field, str(error)) from None


# ---- what is compiled once and kept --------------------------------------------------------------------

_lock = threading.Lock()
_tokenizers: OrderedDict = OrderedDict()  # (id(tokenizer), vocab, eos) -> (tokenizer, LLTokenizer)
_grammars: OrderedDict = OrderedDict()  # (id(LLTokenizer), grammar) -> (LLTokenizer, LLMatcher template)
# Bounds on what is kept: a tokenizer view per distinct EOS set (about as large as the vocabulary), grammars by count
# and by the size of their text (a compiled grammar grows with it). A grammar keeps its tokenizer view alive, so a
# view that goes takes its grammars with it: distinct stop_token_ids per request used to keep 64 views alive.
KEEP_TOKENIZERS, KEEP_GRAMMARS, KEEP_GRAMMAR_CHARS = 4, 64, 16 << 20


def _kept(store: OrderedDict, key, make, over, dropped=None):
    """store[key], made by make() where missing; the least recently used go while `over()` says the store is past its
    bounds (one stays however large), each handed to `dropped`."""
    with _lock:
        if key in store:
            store.move_to_end(key)
            return store[key][1]
    value = make()  # outside the lock: building a tokenizer takes about a second
    with _lock:
        store[key] = value
        while len(store) > 1 and over():
            _, gone = store.popitem(last=False)
            if dropped is not None:
                dropped(gone)
    return value[1]


def _drop_grammars_of(gone) -> None:
    """A tokenizer view that goes takes the grammars compiled against it (their keys name the view)."""
    for stale in [k for k in _grammars if k[0] == id(gone[1])]:
        del _grammars[stale]


def _grammar_chars() -> int:
    return sum(len(grammar) for _, grammar in _grammars)


def llg_tokenizer(tokenizer, vocab: int, eos: tuple[int, ...] = ()):
    """llguidance's view of `tokenizer` (decodekit's Tokenizer or a transformers fast tokenizer) with the
    generation's EOS tokens (the tokenizer's own where there are none), kept."""
    engine = require_engine()

    def make():
        backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "backend", None)
        if backend is None or not hasattr(backend, "to_str"):
            raise ValueError(
                f"structured output needs a tokenizer backed by the tokenizers library (decodekit's, or a "
                f"transformers fast tokenizer); got {type(tokenizer).__name__}."
            )
        ends = list(eos) or getattr(tokenizer, "eos_token_id", None)
        return tokenizer, engine.LLTokenizer(backend.to_str(), n_vocab=vocab, eos_token=ends)

    return _kept(
        _tokenizers, (id(tokenizer), vocab, eos), make, lambda: len(_tokenizers) > KEEP_TOKENIZERS, _drop_grammars_of
    )


class GrammarError(ValueError):
    """The grammar engine's reason a constraint does not compile."""


def compiled(llg_tok, grammar: str):
    """A matcher for `grammar` in its start state, compiled once per (tokenizer, grammar); rows copy it. A
    constraint that does not compile is a GrammarError with the engine's reason (and is not kept)."""
    engine = require_engine()

    def make():
        matcher = engine.LLMatcher(llg_tok, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return llg_tok, matcher

    return _kept(
        _grammars,
        (id(llg_tok), grammar),
        make,
        lambda: len(_grammars) > KEEP_GRAMMARS or _grammar_chars() > KEEP_GRAMMAR_CHARS,
    )


# ---- the processor ---------------------------------------------------------------------------------------


class GrammarLogitsProcessor(Processor):
    """Tokens the constraint does not allow next get -inf, row by row.

    `template`: an llguidance matcher in its start state; `prompt_length`: where generated tokens begin in
    input_ids; `vocab_size`: the scores' width; `eos`: the tokens that end a row. A row whose matcher has
    stopped (the constraint is complete and cannot go on) may take only an EOS token; one that left the
    grammar (a token forced past the mask by something else) is not masked further.
    """

    stage = "constraints"
    host_mask = True  # a compiled step (compile=True) takes step_mask's result as an input
    finishes = True  # finish() reports rows cut off before the constraint allowed an end

    def __init__(self, template, prompt_length: int, vocab_size: int, eos=(), field: str = "constraint"):
        self.template, self.prompt_length, self.vocab_size, self.field = template, prompt_length, vocab_size, field
        self.eos = [t for t in eos if 0 <= t < vocab_size]
        self.states: list[_Row] = []  # the rows of the last call
        self.words = -(-vocab_size // 32)
        self.shifts = torch.arange(32, dtype=torch.int32)
        self.warned = False

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        allowed = self.step_mask(input_ids)
        return scores.masked_fill_(~allowed[:, : scores.shape[-1]].to(scores.device), -math.inf)

    def step_mask(self, input_ids: torch.LongTensor) -> torch.Tensor:
        """bool [rows, vocab_size]: the tokens each row of `input_ids` may take next."""
        return self.allowed(self.advance(input_ids[:, self.prompt_length :].tolist()))

    def allowed(self, matchers) -> torch.Tensor:
        """bool [rows, vocab_size]: what each row may take next (everything for a row no longer constrained)."""
        from llguidance.torch import fill_next_token_bitmask

        bits = torch.full((len(matchers), self.words), -1, dtype=torch.int32)
        stopped = []
        for row, matcher in enumerate(matchers):
            if matcher.is_error():
                continue
            if matcher.is_stopped():
                stopped.append(row)
            else:
                fill_next_token_bitmask(matcher, bits, row)
        allowed = ((bits[:, :, None] >> self.shifts) & 1).bool().view(len(matchers), -1)[:, : self.vocab_size]
        if stopped and self.eos:
            allowed[stopped] = False
            allowed[torch.tensor(stopped)[:, None], torch.tensor(self.eos)[None, :]] = True
        return allowed

    def advance(self, rows: list[list[int]]) -> list:
        """Each row's matcher, brought to the row's tokens from the matcher of the last call whose tokens are
        the longest prefix of them (rolled back where the row has fewer: rejected speculative tokens)."""
        plan = [self._source(tuple(tokens)) for tokens in rows]
        uses = Counter(source for source, _ in plan if source is not None)
        # A matcher several rows continue from (beam search) is copied before any of them moves it.
        spares = {s: [self.states[s].matcher.deep_copy() for _ in range(n - 1)] for s, n in uses.items() if n > 1}
        states = []
        for tokens, (source, common) in zip(rows, plan):
            if source is None:
                matcher, fed, ended = self.template.deep_copy(), 0, False
            else:
                old = self.states[source]
                matcher = spares[source].pop() if spares.get(source) else old.matcher
                fed, ended = old.fed, old.ended and common > old.fed  # the EOS at `fed` is still there
                if common < fed:
                    if not matcher.rollback(fed - common):
                        matcher, common = self.template.deep_copy(), 0
                    fed = common
            for token in tokens[fed:]:
                if ended or matcher.is_error():
                    break  # what follows a row's end is padding
                if token in self.eos and (matcher.is_stopped() or matcher.is_accepting()):
                    ended = True
                elif matcher.consume_token(token):
                    fed += 1
                else:
                    self._left_grammar(token, matcher)
            states.append(_Row(tuple(tokens), matcher, fed, ended))
        self.states = states
        return [row.matcher for row in states]

    def _source(self, tokens: tuple[int, ...]) -> tuple[int | None, int]:
        best, best_length = None, -1
        for index, row in enumerate(self.states):
            if row.matcher.is_error():
                continue  # a matcher never leaves its error state, so it cannot be rolled back to a good one
            n = common_prefix(row.tokens, tokens)
            if n > best_length or (n == best_length and len(row.tokens) == n):
                best, best_length = index, n
        return best, max(best_length, 0)

    def _left_grammar(self, token: int, matcher) -> None:
        if not self.warned:
            self.warned = True
            logger.warning(
                "structured output: token %d is not allowed by the %s here (forced by another processor or "
                "the caller?); that row is no longer constrained (%s)",
                token,
                self.field,
                matcher.get_error(),
            )

    def complete(self, sequences: torch.LongTensor) -> torch.Tensor:
        """bool [rows]: whether each sequence ends where the constraint allows an end."""
        self.advance(sequences[:, self.prompt_length :].tolist())
        return torch.tensor(
            [
                row.ended or row.matcher.is_stopped() or (row.matcher.is_accepting() and not row.matcher.is_error())
                for row in self.states
            ]
        )

    def finish(self, result):
        """generate()'s end: warn about rows cut off before the constraint allowed an end, and put
        `constraint_complete` on a dict output."""
        sequences = result if isinstance(result, torch.Tensor) else getattr(result, "sequences", None)
        if not isinstance(sequences, torch.Tensor):
            return
        done = self.complete(sequences)
        if not bool(done.all()):
            logger.warning(
                "structured output: %d of %d rows ended before the %s allowed an end (max_new_tokens or a "
                "stopping criterion); their output is partial",
                int((~done).sum()),
                len(done),
                self.field,
            )
        if hasattr(result, "constraint_complete"):
            result.constraint_complete = done


@dataclass
class _Row:
    tokens: tuple[int, ...]  # the row's generated tokens
    matcher: object  # its llguidance matcher, which has consumed tokens[:fed]
    fed: int
    ended: bool  # tokens[fed] is an EOS the constraint allowed: the row is over, what follows is padding
