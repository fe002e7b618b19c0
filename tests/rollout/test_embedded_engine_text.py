"""The embedded engine with a tokenizer in the model directory (the tiny character tokenizer, tied embeddings):
text prompts, response text, stop strings, token text in logprobs, and reloading a checkpoint without lm_head."""

import pytest

from slime_hydra.model.config import ModelConfig
from slime_hydra.model.hf import build_random_checkpoint
from slime_hydra.model.tiny import build_tiny_tokenizer
from slime_hydra.rollout.client import SGLangClient
from slime_hydra.rollout.engines import start_embedded_engine
from tests.rollout.helpers import tokens

GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def engine(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("text_engine")
    shape = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_kv_heads=2, ffn_hidden_size=128,
                        tie_word_embeddings=True)
    model_dir = build_random_checkpoint(shape, root / "model", seed=0, tokenizer=tokenizer)
    proc = start_embedded_engine(str(model_dir), log_path=root / "engine.log")
    proc.model_dir = model_dir
    yield proc
    proc.stop()


async def test_text_prompts_and_response_text(engine, tokenizer):
    async with SGLangClient(engine.url) as c:
        info = await c.server_info()
        assert not info["skip_tokenizer_init"] and info["tokenizer_path"]
        by_text = await c.generate_text("12+34=", {**GREEDY, "max_new_tokens": 20}, return_logprob=True,
                                        return_text_in_logprobs=True)
        by_ids = await c.generate(tokenizer.encode("12+34="), {**GREEDY, "max_new_tokens": 20})
        assert tokens(by_text) == tokens(by_ids)
        assert by_text["meta_info"]["prompt_tokens"] == 6
        assert by_text["text"] == tokenizer.decode(tokens(by_text), skip_special_tokens=True)
        for _, token, text in by_text["meta_info"]["output_token_logprobs"]:
            assert text == tokenizer.decode([token])
        batch = await c.generate_text(["12+34=", "7*8="], {**GREEDY, "max_new_tokens": 20})
        assert tokens(batch[0]) == tokens(by_ids) and len(batch) == 2


async def test_stop_strings(engine, tokenizer):
    async with SGLangClient(engine.url) as c:
        full = await c.generate_text("5+5=", {**GREEDY, "max_new_tokens": 40})
        text = full["text"]
        stop = text[6:8]
        start = text.index(stop)
        resp = await c.generate_text("5+5=", {**GREEDY, "max_new_tokens": 40, "stop": [stop, "never-there"]})
        assert resp["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        assert resp["text"] == text[:start]  # trimmed at the match
        assert tokenizer.decode(tokens(resp), skip_special_tokens=True).endswith(stop)
        assert tokens(resp) == tokens(full)[:len(tokens(resp))]
        kept = await c.generate_text("5+5=", {**GREEDY, "max_new_tokens": 40, "stop": stop, "no_stop_trim": True})
        assert kept["text"] == text[:start + len(stop)]


async def test_reload_of_tied_checkpoint(engine):
    """The checkpoint has no lm_head.weight (tied to the embedding): a full reload still counts as complete."""
    async with SGLangClient(engine.url) as c:
        before = await c.generate_text("9-3=", {**GREEDY, "max_new_tokens": 12})
        await c.update_weights_from_disk(str(engine.model_dir))
        assert await c.get_weight_version() == "1"
        assert tokens(await c.generate_text("9-3=", {**GREEDY, "max_new_tokens": 12})) == tokens(before)
