"""The single-turn hook template (rollout/examples/answer_prefix.py) against a real embedded engine: the prefix is
in the response but not trained on, the row's sampling settings reach the engine, the budget counts the prefix, and
a call that fails leaves the sample as it was."""

import asyncio

import pytest

from slime_hydra.buffer.sample import Sample, Status
from slime_hydra.model.config import ModelConfig
from slime_hydra.model.hf import load_tokenizer
from slime_hydra.model.warm_start import build_checkpoint
from slime_hydra.rollout.client import EngineUnavailable, SGLangClient
from slime_hydra.rollout.config import RolloutConfig
from slime_hydra.rollout.engines import start_embedded_engine
from slime_hydra.rollout.examples.answer_prefix import AnswerPrefixGenerate
from slime_hydra.rollout.generate import RolloutContext, get_generate_fn

GREEDY = {"temperature": 0.0, "top_p": 1.0, "top_k": -1}
PREFIX = "Answer: "


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("prefix") / "model"
    build_checkpoint(ModelConfig(num_layers=1, hidden_size=32, ffn_hidden_size=64, tokenizer="char",
                                 sft_warm_start_steps=0), "addition", model_dir, seed=0, log=lambda *_: None)
    proc = start_embedded_engine(str(model_dir), max_batch_size=4, log_path=model_dir.parent / "engine.log")
    yield proc.url, load_tokenizer(model_dir)
    proc.stop()


def run(url: str, tokenizer, sample: Sample, max_new_tokens: int, hook=None) -> Sample:
    hook = hook or get_generate_fn("slime_hydra.rollout.examples.answer_prefix.answer_prefix_generate")

    async def go():
        async with SGLangClient(url) as client:
            ctx = RolloutContext(RolloutConfig(), client, tokenizer, max_context_tokens=256)
            return await hook(ctx, sample, {**GREEDY, "max_new_tokens": max_new_tokens})

    return asyncio.run(go())


def fresh(tokenizer, metadata=None) -> Sample:
    return Sample(prompt="12+34=", tokens=tokenizer.encode("12+34=", add_special_tokens=False),
                  metadata=metadata or {})


def test_the_prefix_is_in_the_response_but_not_trained_on_and_the_row_can_set_sampling(engine):
    url, tokenizer = engine
    n = len(tokenizer.encode(PREFIX, add_special_tokens=False))
    s = run(url, tokenizer, fresh(tokenizer, {"sampling": {"ignore_eos": True}}), max_new_tokens=20)
    assert s.response.startswith(PREFIX) and s.response_length == 20 and s.status is Status.TRUNCATED
    assert s.loss_mask == [0] * n + [1] * (20 - n) and s.rollout_log_probs[:n] == [0.0] * n
    assert all(lp < 0.0 for lp in s.rollout_log_probs[n:]) and len(s.tokens) == s.prompt_length + 20
    assert s.weight_version == 0 and s.prompt_length == len("12+34=")


def test_a_budget_the_prefix_fills_is_truncated_without_a_call(engine):
    url, tokenizer = engine
    n = len(tokenizer.encode(PREFIX, add_special_tokens=False))
    s = run(url, tokenizer, fresh(tokenizer), max_new_tokens=n)
    assert s.status is Status.TRUNCATED and s.response_length == 0


def test_a_failed_call_leaves_the_sample_as_it_was(engine):
    _, tokenizer = engine
    s = fresh(tokenizer)
    before = (list(s.tokens), s.response_length, list(s.loss_mask), s.status)
    with pytest.raises(EngineUnavailable):
        run("http://127.0.0.1:9", tokenizer, s, max_new_tokens=20, hook=AnswerPrefixGenerate())
    assert (s.tokens, s.response_length, s.loss_mask, s.status) == before
