"""The tokenizer read from tokenizer.json + tokenizer_config.json: padding, masks, decoding, chat templates."""

import json

import pytest
import torch
from tokenizers import Tokenizer as Backend
from tokenizers import models, pre_tokenizers, processors

from decodekit import AutoTokenizer

WORDS = ["<pad>", "<s>", "</s>", "hello", "world", "how", "are", "you", "?", "<|user|>", "<|bot|>"]


@pytest.fixture
def tok_dir(tmp_path):
    backend = Backend(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens(["<pad>", "<s>", "</s>", "<|user|>", "<|bot|>"])
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    backend.save(str(tmp_path / "tokenizer.json"))
    template = (
        "{% for m in messages %}{{ '<|' + m['role'] + '|> ' + m['content'] + ' ' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|bot|> ' }}{% endif %}"
    )
    config = {"bos_token": {"content": "<s>"}, "eos_token": "</s>", "pad_token": "<pad>", "chat_template": template}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


def test_left_padding_and_mask(tok_dir):
    tok = AutoTokenizer.from_pretrained(tok_dir)
    enc = tok(["hello world", "how are you ?"], return_tensors="pt", padding=True)
    assert enc.input_ids.tolist() == [[0, 0, 1, 3, 4], [1, 5, 6, 7, 8]]
    assert enc.attention_mask.tolist() == [[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 0)
    plain = tok("hello")
    assert plain["input_ids"] == [1, 3] and tok("hello", add_special_tokens=False)["input_ids"] == [3]
    with pytest.raises(ValueError, match="padding=True"):
        tok(["hello", "how are you"], return_tensors="pt")


def test_decode_and_batch_decode(tok_dir):
    tok = AutoTokenizer.from_pretrained(tok_dir)
    seqs = torch.tensor([[0, 1, 3, 4, 2], [1, 5, 6, 7, 8]])
    assert tok.batch_decode(seqs, skip_special_tokens=True) == ["hello world", "how are you ?"]
    assert tok.decode(seqs[0]) == "<pad> <s> hello world </s>"
    assert tok.decode(3) == "hello"


def test_chat_template_from_config_and_from_jinja_file(tok_dir):
    tok = AutoTokenizer.from_pretrained(tok_dir)
    msgs = [{"role": "user", "content": "how are you ?"}]
    assert (
        tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False) == "<|user|> how are you ? <|bot|> "
    )
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True)
    assert ids == [9, 5, 6, 7, 8, 10]  # the template's text, without an extra BOS
    (tok_dir / "chat_template.jinja").write_text("{{ messages[0]['content'] }}{{ eos_token }}")
    assert AutoTokenizer.from_pretrained(tok_dir).apply_chat_template(msgs, tokenize=False) == "how are you ?</s>"


def test_chat_template_errors(tok_dir):
    tok = AutoTokenizer.from_pretrained(tok_dir)
    with pytest.raises(ValueError, match="list of"):
        tok.apply_chat_template("hello")
    tok.chat_template = None
    with pytest.raises(ValueError, match="no chat_template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        AutoTokenizer.from_pretrained(tmp_path)
