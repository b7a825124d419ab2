"""A tokenizer over the `tokenizers` library, built from tokenizer.json or from GGUF metadata.

The call signature follows transformers (`tokenizer(texts, return_tensors="pt", padding=True)`),
with left padding by default, since decoder-only generation continues from the right end.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
from pathlib import Path
from typing import Any, Sequence

import torch

from .files import resolve_model_dir

logger = logging.getLogger("decodekit")

_TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"]
# What transformers' AutoTokenizer reads where tokenizer.json is missing (its config, BPE or SentencePiece files).
_TRANSFORMERS_TOKENIZER_FILES = [
    "tokenizer_config.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "vocab.txt",
]


class BatchEncoding(dict):
    """input_ids and attention_mask, by key or attribute; `.to(device)` moves tensors."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def to(self, device) -> "BatchEncoding":
        return BatchEncoding({k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in self.items()})


def _token_text(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


class Tokenizer:
    def __init__(
        self,
        backend,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        unk_token: str | None = None,
        chat_template: str | None = None,
        padding_side: str = "left",
    ):
        if padding_side not in ("left", "right"):
            raise ValueError(f"padding_side={padding_side!r} is invalid; expected 'left' or 'right'.")
        self.backend = backend
        self._text_backend = None  # encode_text's copy, made when first needed
        self.bos_token, self.eos_token, self.unk_token = bos_token, eos_token, unk_token
        # Without a pad token, pad with EOS: the attention mask hides padding anyway.
        self.pad_token = pad_token or eos_token
        self.chat_template = chat_template
        self.padding_side = padding_side

    # --- loading -------------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str | os.PathLike,
        revision: str | None = None,
        gguf_file: str | None = None,
        local_files_only: bool = False,
        token: str | bool | None = None,
        padding_side: str = "left",
    ) -> "Tokenizer":
        path = Path(name_or_path).expanduser()
        if gguf_file is None and path.is_file() and path.suffix == ".gguf":
            path, gguf_file = path.parent, path.name
            name_or_path = path
        if gguf_file is not None:
            model_dir = resolve_model_dir(name_or_path, revision, local_files_only, token, allow_patterns=[gguf_file])
            return cls.from_gguf(model_dir / gguf_file, padding_side=padding_side)
        model_dir = resolve_model_dir(name_or_path, revision, local_files_only, token, allow_patterns=_TOKENIZER_FILES)
        return cls.from_directory(model_dir, padding_side=padding_side)

    @classmethod
    def from_directory(cls, model_dir: Path, padding_side: str = "left") -> "Tokenizer":
        from tokenizers import Tokenizer as Backend

        if not (model_dir / "tokenizer.json").is_file():
            raise FileNotFoundError(
                f"{model_dir} has no tokenizer.json; decodekit reads tokenizer.json or a GGUF file, and "
                "transformers (the decodekit[transformers] extra) vocab.json + merges.txt or a "
                "SentencePiece model with tokenizer_config.json."
            )
        backend = Backend.from_file(str(model_dir / "tokenizer.json"))
        config: dict[str, Any] = {}
        for name in ("special_tokens_map.json", "tokenizer_config.json"):
            if (model_dir / name).is_file():
                config.update(json.loads((model_dir / name).read_text(encoding="utf-8")))
        template = config.get("chat_template")
        if (model_dir / "chat_template.jinja").is_file():
            template = (model_dir / "chat_template.jinja").read_text(encoding="utf-8")
        return cls(
            backend,
            bos_token=_token_text(config.get("bos_token")),
            eos_token=_token_text(config.get("eos_token")),
            pad_token=_token_text(config.get("pad_token")),
            unk_token=_token_text(config.get("unk_token")),
            chat_template=template,
            padding_side=padding_side,
        )

    @classmethod
    def from_gguf(cls, path: str | Path, padding_side: str = "left") -> "Tokenizer":
        from .gguf_file import open_gguf

        fields = open_gguf(path).tokenizer_fields()
        backend = byte_level_bpe(fields)
        tokens = fields["tokens"]

        def text(key):
            i = fields.get(key)
            return tokens[i] if i is not None and 0 <= i < len(tokens) else None

        return cls(
            backend,
            bos_token=text("bos_token_id"),
            eos_token=text("eos_token_id"),
            pad_token=text("pad_token_id"),
            unk_token=text("unk_token_id"),
            chat_template=fields.get("chat_template"),
            padding_side=padding_side,
        )

    # --- ids -----------------------------------------------------------------------------------------

    def convert_tokens_to_ids(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    def get_vocab(self) -> dict[str, int]:
        """{token: id} for the whole vocabulary, added tokens included (transformers' method of that name)."""
        return self.backend.get_vocab(with_added_tokens=True)

    def convert_ids_to_tokens(self, ids: int | Sequence[int]):
        if isinstance(ids, int):
            return self.backend.id_to_token(ids)
        return [self.backend.id_to_token(i) for i in ids]

    @property
    def bos_token_id(self) -> int | None:
        return self.convert_tokens_to_ids(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return self.convert_tokens_to_ids(self.eos_token)

    @property
    def pad_token_id(self) -> int | None:
        return self.convert_tokens_to_ids(self.pad_token)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    # --- encoding ------------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_text(self, text: str) -> list[int]:
        """`text`'s ids with special and added tokens spelled in it tokenized as plain text (no BOS added)."""
        if self._text_backend is None:  # a copy that splits special tokens: the shared backend's flag stays as it is
            from tokenizers import Tokenizer as Backend

            copy = Backend.from_str(self.backend.to_str())
            copy.encode_special_tokens = True
            self._text_backend = copy
        return self._text_backend.encode(text, add_special_tokens=False).ids

    def __call__(
        self,
        text: str | Sequence[str],
        return_tensors: str | None = None,
        padding: bool | str = False,
        add_special_tokens: bool = True,
    ) -> BatchEncoding:
        single = isinstance(text, str)
        texts = [text] if single else list(text)
        if not texts or not all(isinstance(t, str) for t in texts):
            raise ValueError("tokenizer() takes a string or a non-empty list of strings.")
        if return_tensors not in (None, "pt"):
            raise ValueError(f"return_tensors={return_tensors!r} is not supported; use 'pt' or None.")
        if padding not in (True, False, "longest"):
            raise ValueError(f"padding={padding!r} is not supported; use True, False or 'longest'.")
        ids = [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=add_special_tokens)]
        masks = [[1] * len(i) for i in ids]
        if padding or (return_tensors == "pt" and len({len(i) for i in ids}) > 1):
            if not padding:
                raise ValueError("The texts have different lengths; pass padding=True to batch them.")
            ids, masks = self._pad(ids, masks)
        if return_tensors == "pt":
            return BatchEncoding(
                input_ids=torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(masks, dtype=torch.long)
            )
        if single:
            return BatchEncoding(input_ids=ids[0], attention_mask=masks[0])
        return BatchEncoding(input_ids=ids, attention_mask=masks)

    def _pad(self, ids, masks):
        pad_id = self.pad_token_id
        if pad_id is None:
            raise ValueError("This tokenizer has no pad or EOS token to pad with; set tokenizer.pad_token.")
        width = max(len(i) for i in ids)
        out_ids, out_masks = [], []
        for i, m in zip(ids, masks):
            fill = width - len(i)
            if self.padding_side == "left":
                out_ids.append([pad_id] * fill + i)
                out_masks.append([0] * fill + m)
            else:
                out_ids.append(i + [pad_id] * fill)
                out_masks.append(m + [0] * fill)
        return out_ids, out_masks

    # --- decoding ------------------------------------------------------------------------------------

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        if isinstance(ids, int):
            ids = [ids]
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def batch_decode(self, sequences, skip_special_tokens: bool = False) -> list[str]:
        if isinstance(sequences, torch.Tensor):
            sequences = sequences.tolist()
        return self.backend.decode_batch([list(s) for s in sequences], skip_special_tokens=skip_special_tokens)

    # --- chat ----------------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, str]],
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        return_tensors: str | None = None,
        return_dict: bool = False,
        chat_template: str | None = None,
        **template_kwargs,
    ):
        """Renders `messages` with the model's Jinja chat template (sandboxed), then tokenizes unless tokenize=False."""
        template = chat_template or self.chat_template
        if template is None:
            raise ValueError("This tokenizer has no chat_template; pass chat_template=... (a Jinja string).")
        if not isinstance(messages, (list, tuple)) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise ValueError("messages must be a list of {'role': ..., 'content': ...} dictionaries.")
        text = render_chat_template(
            template,
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **template_kwargs,
        )
        if not tokenize:
            return text
        # The template already wrote the special tokens it wants.
        encoded = self(text, return_tensors=return_tensors, add_special_tokens=False)
        return encoded if return_dict else encoded["input_ids"]


def prompt_ids(tokenizer, text: str, chat: bool = False) -> torch.Tensor:
    """`text` as input_ids [1, length] for `tokenizer` (decodekit's or a transformers one); with `chat`, as a user
    message through the tokenizer's chat template, ready for the assistant's reply."""
    if not chat:
        return tokenizer(text, return_tensors="pt")["input_ids"]
    return torch.tensor([chat_ids(tokenizer, [{"role": "user", "content": text}])])


def chat_ids(
    tokenizer,
    messages: Sequence[dict[str, str]],
    content_as_text: bool = False,
    continue_final: bool = False,
    **template_kwargs,
) -> list[int]:
    """The token ids of `messages` through the tokenizer's chat template, ready for the assistant's reply.

    With `content_as_text` (a server's untrusted messages), text inside a message that spells a special or added
    token, say "<|im_start|>system", stays text: only the template's own markers become special tokens, as in
    vLLM's and llama.cpp's servers. Messages without such text tokenize exactly as without the flag.
    With `continue_final` (vLLM's continue_final_message), the last message is an assistant's reply cut short,
    and the ids end where its text ends (no end of turn, no new turn), so the model goes on with it.
    `template_kwargs` (tools=, ...) go to the template."""
    if continue_final:
        if not messages or messages[-1].get("role") != "assistant" or not str(messages[-1].get("content") or ""):
            raise ValueError(
                "continue_final_message needs the last message to be an assistant's, with text to go on from."
            )
        return _chat_ids_content_as_text(tokenizer, list(messages), template_kwargs, content_as_text, continue_final)
    if content_as_text:
        markers = added_token_texts(tokenizer)
        if any(marker in str(m.get("content") or "") for m in messages for marker in markers):
            return _chat_ids_content_as_text(tokenizer, list(messages), template_kwargs)
    ids = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, **template_kwargs)
    if not isinstance(ids, list):  # transformers' tokenizers: a BatchEncoding
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def added_token_texts(tokenizer) -> list[str]:
    """The texts of a tokenizer's special and added tokens (decodekit's or a transformers one)."""
    backend = getattr(tokenizer, "backend", None)
    decoder = (
        backend.get_added_tokens_decoder()
        if backend is not None and hasattr(backend, "get_added_tokens_decoder")
        else getattr(tokenizer, "added_tokens_decoder", {})
    )
    return [
        str(getattr(token, "content", token)) for token in decoder.values() if str(getattr(token, "content", token))
    ]


def special_token_texts(tokenizer) -> list[str]:
    """The texts of a tokenizer's special tokens (what decode(skip_special_tokens=True) leaves out): decodekit's
    tokenizer or a transformers one."""
    backend = getattr(tokenizer, "backend", None)
    if backend is not None and hasattr(backend, "get_added_tokens_decoder"):
        return [str(t.content) for t in backend.get_added_tokens_decoder().values() if getattr(t, "special", False)]
    return list(getattr(tokenizer, "all_special_tokens", []))


def encode_as_text(tokenizer, text: str) -> list[int]:
    """`text`'s ids with every special or added token spelled in it tokenized as plain text."""
    if hasattr(tokenizer, "encode_text"):
        return tokenizer.encode_text(text)
    return list(tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])


def _chat_ids_content_as_text(
    tokenizer, messages: list[dict], template_kwargs: dict, as_text: bool = True, continue_final: bool = False
) -> list[int]:
    """The template rendered with a marker in place of each content (unguessable, so no content can forge one),
    the template's text tokenized as usual and each content as text (`as_text`; else as encode() reads it). With
    `continue_final`, the text ends at the last message's content."""
    tag = secrets.token_hex(8)
    marks = {f"\ue000{tag}{i}\ue001": str(m.get("content") or "") for i, m in enumerate(messages)}
    stand_ins = [{**m, "content": mark} for m, mark in zip(messages, marks)]
    text = tokenizer.apply_chat_template(
        stand_ins, add_generation_prompt=not continue_final, tokenize=False, **template_kwargs
    )
    if continue_final:
        last = list(marks)[-1]
        if last not in text:
            raise ValueError("continue_final_message: this chat template does not show the last message's text.")
        text = text[: text.index(last) + len(last)]

    def content_ids(content: str) -> list[int]:
        return encode_as_text(tokenizer, content) if as_text else tokenizer.encode(content, add_special_tokens=False)

    pattern = re.compile("|".join(re.escape(mark) for mark in marks))
    ids, at = [], 0
    for found in pattern.finditer(text):
        ids += tokenizer.encode(text[at : found.start()], add_special_tokens=False) if found.start() > at else []
        ids += content_ids(marks[found.group()])
        at = found.end()
    ids += tokenizer.encode(text[at:], add_special_tokens=False) if at < len(text) else []
    return [int(t) for t in ids]


def render_chat_template(template: str, **context) -> str:
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, indent=indent, ensure_ascii=False)
    return env.from_string(template).render(**context)


# GGUF `tokenizer.ggml.pre` -> how text is split before BPE. SmolLM splits digits one by one.
_DIGIT_SPLITTING_PRE = {"smollm", "starcoder", "refact"}


def byte_level_bpe(fields: dict[str, Any]):
    """A byte-level BPE tokenizer (GPT-2 style, `tokenizer.ggml.model == "gpt2"`) from GGUF vocab and merges."""
    from tokenizers import AddedToken, Tokenizer as Backend, decoders, models, pre_tokenizers, processors

    if fields.get("model") != "gpt2":
        raise ValueError(
            f"GGUF tokenizer model {fields.get('model')!r} is not supported; decodekit builds 'gpt2' (byte-level BPE) tokenizers."
        )
    tokens = fields["tokens"]
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in fields["merges"]]
    backend = Backend(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if fields.get("pre") in _DIGIT_SPLITTING_PRE:
        backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        backend.pre_tokenizer = byte_level
    backend.decoder = decoders.ByteLevel()
    # token_type 3 is CONTROL (special), 4 USER_DEFINED: both are matched whole, never split by BPE.
    types = fields.get("token_type") or []
    backend.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types) if t == 3]
    )
    backend.add_tokens([AddedToken(tokens[i], normalized=False) for i, t in enumerate(types) if t == 4])
    bos = fields.get("bos_token_id")
    if fields.get("add_bos_token") and bos is not None:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A {tokens[bos]} $B", special_tokens=[(tokens[bos], bos)]
        )
    else:
        backend.post_processor = processors.ByteLevel(trim_offsets=False)
    return backend


class AutoTokenizer:
    """decodekit's Tokenizer where it can build one (tokenizer.json or a GGUF file's vocabulary), transformers'
    AutoTokenizer otherwise (vocab.json + merges.txt, SentencePiece models, ...)."""

    @staticmethod
    def from_pretrained(
        name_or_path: str | os.PathLike,
        revision: str | None = None,
        gguf_file: str | None = None,
        local_files_only: bool = False,
        token: str | bool | None = None,
        padding_side: str = "left",
        backend: str | None = None,
        **transformers_kwargs,
    ):
        """`backend`: None picks native where decodekit reads the tokenizer; "native" or "transformers" forces one."""
        from ..facade.transformers_model import TRANSFORMERS_EXTRA
        from ..facade.transformers_model import installed as transformers_installed
        from .files import check_backend

        check_backend(backend)
        options = dict(
            revision=revision,
            gguf_file=gguf_file,
            local_files_only=local_files_only,
            token=token,
            padding_side=padding_side,
        )
        path = Path(name_or_path).expanduser()
        native = gguf_file is not None or path.suffix == ".gguf"
        readable = True  # by transformers, as far as the files tell
        if not native:
            files = resolve_model_dir(name_or_path, revision, local_files_only, token, allow_patterns=_TOKENIZER_FILES)
            native = (files / "tokenizer.json").is_file()
            readable = any((files / name).is_file() for name in _TRANSFORMERS_TOKENIZER_FILES)
        if backend == "native" or (backend is None and (native or not readable)):
            if transformers_kwargs:
                raise TypeError(
                    f"AutoTokenizer.from_pretrained() got {sorted(transformers_kwargs)}, which only the "
                    "transformers backend takes."
                )
            return Tokenizer.from_pretrained(name_or_path, **options)
        if backend is None:
            label, why = str(name_or_path), "no tokenizer.json (decodekit reads tokenizer.json or a GGUF vocabulary)"
            logger.info("loading the tokenizer of %s with transformers: %s", label, why)
            if not transformers_installed():
                raise FileNotFoundError(
                    f"{label} has {why}; transformers can read its other formats: install it with\n"
                    f"    {TRANSFORMERS_EXTRA}"
                )
        from .via_transformers import load_tokenizer

        return load_tokenizer(name_or_path, **options, **transformers_kwargs)
