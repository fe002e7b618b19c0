"""The tiny model's offline character tokenizer: vocabulary, exact round-trips, ChatML template, save/load."""

import json

import pytest

from slime_hydra.model.config import ModelConfig
from slime_hydra.model.hf import build_random_checkpoint, load_tokenizer
from slime_hydra.model.tiny import build_tiny_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def test_vocabulary_is_small_with_fixed_special_ids(tok):
    assert len(tok) == 101  # 5 special + 95 printable ASCII + newline, under the tiny model's 128 rows
    assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 4)
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [2, 3]
    assert tok.pad_token == "<|pad|>" and tok.eos_token == "<|endoftext|>"


@pytest.mark.parametrize("text", ["12+34=", "Hello, World! ~{}[]|\\'\"`", "a  b\nc", " 7 ", ""])
def test_one_token_per_character_and_exact_round_trip(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == len(text)
    assert tok.decode(ids) == text


def test_digits_are_consecutive_ids(tok):
    ids = tok.encode("0123456789", add_special_tokens=False)
    assert ids == list(range(ids[0], ids[0] + 10))


def test_special_tokens_are_single_ids_and_unknown_characters_map_to_unk(tok):
    assert tok.encode("<|im_start|>x<|im_end|>", add_special_tokens=False) == [2, 93, 3]
    assert tok.encode("é", add_special_tokens=False) == [4]
    assert tok.decode([2, 93, 3, 1], skip_special_tokens=True) == "x"


def test_no_special_tokens_added_by_default(tok):
    assert tok("ab")["input_ids"] == tok.encode("ab", add_special_tokens=False)


def test_chat_template_chatml_with_generation_prompt(tok):
    messages = [{"role": "system", "content": "Add."}, {"role": "user", "content": "1+2="}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nAdd.<|im_end|>\n<|im_start|>user\n1+2=<|im_end|>\n"
                    "<|im_start|>assistant\n")
    assert tok.apply_chat_template(messages[1:], tokenize=False) == "<|im_start|>user\n1+2=<|im_end|>\n"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids.count(2) == 3 and ids.count(3) == 2 and tok.decode(ids) == text


def test_chat_template_renders_tools_as_json(tok):
    tools = [{"type": "function", "function": {"name": "calc"}}]
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tools=tools, tokenize=False)
    header = "<|im_start|>system\n# Tools\n"
    assert text.startswith(header)
    assert json.loads(text[len(header): text.index("<|im_end|>")]) == tools
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n")


def test_save_and_reload_gives_the_same_tokenizer(tmp_path, tok):
    """Saved next to a qwen2 config.json (as in a checkpoint), where AutoTokenizer would swap in Qwen2Tokenizer."""
    build_random_checkpoint(ModelConfig(), tmp_path / "tok", tokenizer=tok)
    loaded = load_tokenizer(tmp_path / "tok")
    text = tok.apply_chat_template([{"role": "user", "content": "9+9="}], tokenize=False, add_generation_prompt=True)
    assert loaded.apply_chat_template([{"role": "user", "content": "9+9="}], tokenize=False,
                                      add_generation_prompt=True) == text
    assert loaded.encode(text, add_special_tokens=False) == tok.encode(text, add_special_tokens=False)
    assert (loaded.pad_token_id, loaded.eos_token_id, len(loaded)) == (0, 1, 101)
    assert loaded.decode(loaded.encode("x=1\n", add_special_tokens=False)) == "x=1\n"
