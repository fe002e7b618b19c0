"""The byte-level BPE tokenizer a built model trains on its task's text (model/bpe.py), and the build that uses it."""

import json

import pytest
import torch

from slime_hydra.config import compose, to_config
from slime_hydra.data.dataset import sft_levels
from slime_hydra.data.tasks import arithmetic, get_task
from slime_hydra.model.bpe import MIN_VOCAB, build_bpe_tokenizer
from slime_hydra.model.hf import load_tokenizer
from slime_hydra.model.tiny import build_tiny_tokenizer
from slime_hydra.model.warm_start import cache_dir, resolve_model_path


def corpus(n=2000):
    rows = get_task("countdown").sft_rows(n, seed=0, levels=[1, 2]) + get_task("arithmetic").sft_rows(n, levels=[1, 2, 3])
    return [text for r in rows for text in (r["prompt"], r["response"])]


@pytest.fixture(scope="module")
def tok():
    return build_bpe_tokenizer(corpus(), 400)


def test_special_tokens_keep_the_character_tokenizers_ids(tok):
    assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 4)
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [2, 3]
    assert MIN_VOCAB < len(tok) <= 400


def test_words_merge_but_digits_stay_one_per_token(tok):
    text = "Make 71 from 3 7 25 2 using + - * /:"
    ids = tok.encode(text, add_special_tokens=False)
    tokens = tok.convert_ids_to_tokens(ids)
    assert "Make" in tokens and "Ġfrom" in tokens and "Ġusing" in tokens  # whole words after training
    assert len(ids) < len(text)
    digits = [t.lstrip("Ġ") for t in tokens if any(c.isdigit() for c in t)]
    assert digits == ["7", "1", "3", "7", "2", "5", "2"]  # every digit its own token, no space merged in


@pytest.mark.parametrize("text", ["12+34=", "93-88*91=", "sort 41 7 19 =", " 7 ", "a  b\nc", "é€ ünïcode ☃", ""])
def test_exact_round_trip_of_any_text(tok, text):
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_same_chat_template_as_the_character_tokenizer(tok):
    messages = [{"role": "user", "content": "37*12-5="}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == build_tiny_tokenizer().apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    tokens = tok.convert_ids_to_tokens(tok(text, add_special_tokens=False)["input_ids"])
    assert tokens[:2] == ["<|im_start|>", "user"] and tokens[-2:] == ["assistant", "Ċ"]  # role words are one token


def test_training_is_deterministic_and_the_vocabulary_is_bounded():
    texts = corpus(500)
    assert build_bpe_tokenizer(texts, 300).get_vocab() == build_bpe_tokenizer(texts, 300).get_vocab()
    assert len(build_bpe_tokenizer(texts, 270)) == 270
    with pytest.raises(ValueError, match="at least 261"):
        build_bpe_tokenizer(texts, 200)


def test_saved_tokenizer_loads_back_identically(tok, tmp_path):
    from slime_hydra.model.hf import save_tokenizer

    save_tokenizer(tok, tmp_path)
    back = load_tokenizer(tmp_path)
    text = "<|im_start|>user\nsort 41 7 19 =<|im_end|>\n"
    assert back(text)["input_ids"] == tok(text)["input_ids"] and back.chat_template == tok.chat_template


SMALL_ON_CPU = ("model=small", "data=arithmetic", "reward=task", "data.adaptive.enabled=true",
                "data.adaptive.max_level=3", "model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128",
                "model.num_attention_heads=4", "model.num_kv_heads=2", "model.sft_warm_start_steps=30",
                "model.sft_batch_size=32", "model.sft_lr=3e-3")
"""model=small at reduced size: the GPU recipe's build (BPE tokenizer, SFT on the run's levels) on this CPU."""


def test_model_small_builds_offline_with_its_bpe_tokenizer_on_the_runs_levels(tmp_path, monkeypatch):
    monkeypatch.setenv("SLIME_HYDRA_CACHE", str(tmp_path))
    cfg = to_config(compose(list(SMALL_ON_CPU)))
    assert sft_levels(cfg.data) == [1, 2, 3]
    logs = []
    path = resolve_model_path(cfg.model, cfg.data, cfg.seed, log=logs.append)
    assert path.parent == tmp_path and path.name.startswith("small-arithmetic-")
    assert json.loads((path / "tokenizer.json").read_text())["model"]["type"] == "BPE"
    assert json.loads((path / "build_key.json").read_text())["levels"] == [1, 2, 3]
    tok = load_tokenizer(path)
    assert tok.decode(tok.encode("37*12-5=", add_special_tokens=False)) == "37*12-5="
    final_loss = float(logs[-1].split("final loss ")[1])
    assert final_loss < 3.0  # from ln(1024) ~ 6.9 at random init: the SFT learned the answer format
    from transformers import AutoModelForCausalLM

    net = AutoModelForCausalLM.from_pretrained(path)
    assert net.config.vocab_size == 1024 and len(tok) <= 1024
    assert not any(torch.isnan(p).any() for p in net.parameters())
    # The cache key holds the levels and the task's problems: another max_level, or a level whose problems changed,
    # is another build; the same config finds the first.
    assert resolve_model_path(cfg.model, cfg.data, cfg.seed, log=logs.append) == path
    assert cache_dir(cfg.model, cfg.data, cfg.seed)[0] == path
    other = to_config(compose([*SMALL_ON_CPU, "data.adaptive.max_level=2"]))
    assert cache_dir(other.model, other.data, other.seed)[0] != path
    monkeypatch.setitem(arithmetic.LEVELS, 3, (3, 2, "+-"))
    assert cache_dir(cfg.model, cfg.data, cfg.seed)[0] != path


def test_a_build_in_a_child_process_gives_the_same_weights_and_passes_its_log(tmp_path, monkeypatch):
    """Where CUDA is available the driver builds in a child process (so it holds no CUDA context afterwards); here
    the child is forced: bitwise the weights of an in-process build, its output lines reach ``log``."""
    from safetensors.torch import load_file

    tiny = to_config(compose(["model.num_layers=1", "model.hidden_size=32", "model.ffn_hidden_size=64",
                              "model.num_attention_heads=2", "model.num_kv_heads=1", "model.sft_warm_start_steps=5"]))
    paths, logs = {}, {}
    for in_child in (False, True):
        monkeypatch.setenv("SLIME_HYDRA_CACHE", str(tmp_path / str(in_child)))
        logs[in_child] = []
        paths[in_child] = resolve_model_path(tiny.model, tiny.data, tiny.seed, log=logs[in_child].append,
                                             in_child=in_child)
    here, child = (load_file(paths[flag] / "model.safetensors") for flag in (False, True))
    assert here.keys() == child.keys() and all(torch.equal(here[k], child[k]) for k in here)
    assert any(line.startswith("  SFT warm start: 5 steps") for line in logs[True])
    bad = tiny.model.__class__(**{**tiny.model.__dict__, "vocab_size": 8})  # below the character tokenizer's size
    monkeypatch.setenv("SLIME_HYDRA_CACHE", str(tmp_path / "bad"))
    with pytest.raises(RuntimeError, match="failed in its child process"):
        resolve_model_path(bad, tiny.data, tiny.seed, log=lambda *_: None, in_child=True)
    assert not list((tmp_path / "bad").iterdir())  # nothing half-made is left
