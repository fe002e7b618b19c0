"""The calculator generate hook against a real embedded engine, and its evaluator.

A random tiny model never writes ``<calc>``, so the engine serves a tiny model (the character tokenizer) that was
fine-tuned for a few seconds to reproduce two tool-using scripts under greedy decoding. The engine stops at
``</calc>`` because the hook asks it to (SGLang's ``stop``), and every tool result in the samples is computed by the
hook's evaluator: the model never generates those tokens, their logprobs are 0 and their loss mask is 0.
"""

import asyncio

import pytest
import torch

from slime_hydra.buffer.sample import Sample, Status
from slime_hydra.model.config import ModelConfig
from slime_hydra.model.warm_start import build_checkpoint
from slime_hydra.model.hf import load_tokenizer
from slime_hydra.rollout.client import SGLangClient
from slime_hydra.rollout.config import RolloutConfig
from slime_hydra.rollout.engines import start_embedded_engine
from slime_hydra.rollout.generate import RolloutContext, get_generate_fn
from slime_hydra.rollout.examples.calculator_tool import CalculatorGenerate, Limits, ToolError, evaluate, run_calculator
from slime_hydra.train.prepare import to_train_batch

SCRIPTS = {
    "Q1 ": "<calc>12*(3+4)</calc><result>84</result><calc>84-4</calc><result>80</result>=80",
    "Q2 ": "<calc>1/0</calc><result>error: division by zero</result>=?",
}
"""Prompt -> what the fine-tuned model writes, tool results included (the hook supplies those)."""
GREEDY = {"temperature": 0.0, "top_p": 1.0, "top_k": -1}


# ---- the evaluator -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("expression, value", [
    ("12*(3+4)", "84"), ("7/2", "3.5"), ("12/4", "3"), ("-3**2", "-9"), ("(-3)**2", "9"), ("10//3", "3"),
    ("-7%3", "2"), ("2**0.5", "1.41421356237"), (" 1.5e3 + 2 ", "1502"), ("+4--2", "6"), ("2**-2", "0.25"),
    ("((((1))))", "1"), ("99999999999*99999", "9999899999900001"),
])
def test_evaluator_values(expression, value):
    assert run_calculator(expression) == value


@pytest.mark.parametrize("expression, message", [
    ("1/0", "error: division by zero"),
    ("5//0", "error: division by zero"),
    ("0**-1", "error: division by zero"),
    ("", "error: empty expression"),
    ("a+1", "error: unsupported element Name"),
    ("__import__('os').system('x')", "error: unsupported element Call"),
    ("(1).real", "error: unsupported element Attribute"),
    ("1 < 2", "error: unsupported element Compare"),
    ("2 ^ 3", "error: unsupported operator BitXor"),
    ("~5", "error: unsupported operator Invert"),
    ("True + 1", "error: unsupported constant True"),
    ("'a' * 3", "error: unsupported constant 'a'"),
    ("(1", "error: not an arithmetic expression ('(' was never closed)"),
    ("2**65", "error: exponent 65 beyond 64"),
    ("9**9**9", "error: exponent 387420489 beyond 64"),
    ("10**19", "error: result beyond 1e+18"),
    ("1e308*10", "error: result beyond 1e+18"),
    ("(-8)**0.5", "error: complex result (negative number to a fractional power)"),
    ("1" + "+1" * 40, "error: expression has more than 64 terms"),
    ("1" * 201, "error: expression longer than 200 characters"),
])
def test_evaluator_refusals_are_messages(expression, message):
    assert run_calculator(expression) == message


def test_evaluator_limits_and_errors():
    assert evaluate("2**10", Limits(max_exponent=10)) == 1024
    with pytest.raises(ToolError, match="^exponent 11 beyond 10$"):
        evaluate("2**11", Limits(max_exponent=10))
    assert isinstance(evaluate("6/3"), float) and isinstance(evaluate("6//3"), int)


# ---- the hook against the engine -----------------------------------------------------------------------------------

def fine_tune(model_dir, tokenizer) -> None:
    """Teach the tiny model SCRIPTS (loss on the completions only) until greedy decoding reproduces every token,
    with some margin (loss < 0.05); ~5 s on one core."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    net = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    rows = [(tokenizer.encode(p, add_special_tokens=False),
             tokenizer.encode(c, add_special_tokens=False) + [tokenizer.eos_token_id]) for p, c in SCRIPTS.items()]
    width = max(len(p) + len(c) for p, c in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    labels = torch.full((len(rows), width), -100)
    for i, (p, c) in enumerate(rows):
        ids[i, :len(p) + len(c)] = torch.tensor(p + c)
        labels[i, len(p):len(p) + len(c)] = torch.tensor(c)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    for _ in range(400):
        loss = net(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            pred = net(input_ids=ids).logits[:, :-1].argmax(-1)
        scored = labels[:, 1:] != -100
        if bool((pred[scored] == labels[:, 1:][scored]).all()) and loss.item() < 0.05:
            break
    else:
        raise AssertionError(f"the tool scripts were not memorised (loss {loss.item():.3f})")
    net.save_pretrained(model_dir, safe_serialization=True)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("calc") / "model"
    build_checkpoint(ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128, tokenizer="char"), "addition",
                     model_dir, seed=0, log=lambda *_: None)
    tokenizer = load_tokenizer(model_dir)
    fine_tune(model_dir, tokenizer)
    proc = start_embedded_engine(str(model_dir), max_batch_size=4, log_path=model_dir.parent / "engine.log")
    yield proc.url, tokenizer
    proc.stop()


def run_hook(engine, prompt: str, max_new_tokens: int = 128, hook=None, client_cls=SGLangClient, sample=None,
             **params) -> Sample:
    url, tokenizer = engine
    hook = hook or get_generate_fn("slime_hydra.rollout.examples.calculator_tool.calculator_generate")
    sample = sample or Sample(prompt=prompt, tokens=tokenizer.encode(prompt, add_special_tokens=False))

    async def go():
        async with client_cls(url) as client:
            ctx = RolloutContext(RolloutConfig(), client, tokenizer, max_context_tokens=256)
            return await hook(ctx, sample, {**GREEDY, "max_new_tokens": max_new_tokens, **params})

    return asyncio.run(go())


def segments(sample: Sample, tokenizer) -> list[tuple[int, str]]:
    """The response as (mask, text) runs of equal loss mask."""
    out, start = [], sample.prompt_length
    mask = sample.loss_mask
    i = 0
    while i < len(mask):
        j = i
        while j < len(mask) and mask[j] == mask[i]:
            j += 1
        out.append((mask[i], tokenizer.decode(sample.tokens[start + i:start + j], skip_special_tokens=True)))
        i = j
    return out


def check_layout(sample: Sample) -> None:
    assert len(sample.tokens) == sample.prompt_length + sample.response_length
    assert len(sample.loss_mask) == len(sample.rollout_log_probs) == sample.response_length
    for m, lp in zip(sample.loss_mask, sample.rollout_log_probs):
        assert (lp == 0.0) if m == 0 else (lp < 0.0)  # tool tokens: 0; sampled tokens: a real logprob


def test_two_tool_calls_then_answer(engine):
    _, tokenizer = engine
    s = run_hook(engine, "Q1 ")
    check_layout(s)
    assert segments(s, tokenizer) == [(1, "<calc>12*(3+4)</calc>"), (0, "<result>84</result>"),
                                      (1, "<calc>84-4</calc>"), (0, "<result>80</result>"), (1, "=80")]
    assert s.response == SCRIPTS["Q1 "]
    assert s.response_length == len(SCRIPTS["Q1 "]) + 1  # one token per character, plus EOS
    assert s.tokens[-1] == tokenizer.eos_token_id
    assert (s.status, s.metadata["tool_calls"], sum(s.loss_mask)) == (Status.COMPLETED, 2, 21 + 17 + 3 + 1)

    s.reward = 1.0
    batch = to_train_batch([s], pad_id=tokenizer.pad_token_id)
    assert batch.loss_mask[0].tolist() == [float(m) for m in s.loss_mask]
    tool = [i for i, m in enumerate(s.loss_mask) if m == 0]
    assert tool == list(range(21, 40)) + list(range(57, 76))  # the two <result>...</result> runs, 19 tokens each
    assert batch.extras["rollout_logprobs"][0, tool].abs().sum().item() == 0.0


def test_tool_error_is_a_message(engine):
    _, tokenizer = engine
    s = run_hook(engine, "Q2 ")
    check_layout(s)
    assert segments(s, tokenizer) == [(1, "<calc>1/0</calc>"), (0, "<result>error: division by zero</result>"),
                                      (1, "=?")]
    assert (s.status, s.metadata["tool_calls"], s.metadata["tool_errors"]) == (Status.COMPLETED, 1, 1)


def test_max_turns_ends_at_the_unanswered_call(engine):
    _, tokenizer = engine
    s = run_hook(engine, "Q1 ", hook=CalculatorGenerate(max_turns=1))
    check_layout(s)
    assert segments(s, tokenizer) == [(1, "<calc>12*(3+4)</calc>"), (0, "<result>84</result>"),
                                      (1, "<calc>84-4</calc>")]
    assert (s.status, s.metadata["tool_calls"], s.response_length) == (Status.COMPLETED, 1, 21 + 19 + 17)


def test_budget_counts_tool_tokens(engine):
    _, tokenizer = engine
    s = run_hook(engine, "Q1 ", max_new_tokens=45)  # turn 1 (21) + result (19) leave 5 tokens for turn 2
    check_layout(s)
    assert segments(s, tokenizer) == [(1, "<calc>12*(3+4)</calc>"), (0, "<result>84</result>"), (1, "<calc")]
    assert (s.status, s.response_length) == (Status.TRUNCATED, 45)
    s = run_hook(engine, "Q1 ", max_new_tokens=30)  # the 19-token result does not fit in the 9 left: left out
    check_layout(s)
    assert segments(s, tokenizer) == [(1, "<calc>12*(3+4)</calc>")]
    assert (s.status, s.response_length, s.metadata["tool_calls"]) == (Status.TRUNCATED, 21, 0)


class AbortSecondTurn(SGLangClient):
    """A real client that, on the second /generate, holds the engine (pause in place), sends the request, aborts
    everything once the engine has it queued, and lets the engine continue: the turn comes back aborted."""

    calls = 0

    async def generate(self, *args, **kwargs):
        type(self).calls += 1
        if type(self).calls != 2:
            return await super().generate(*args, **kwargs)
        await self.pause_generation("in_place")
        task = asyncio.ensure_future(super().generate(*args, **kwargs))
        while (await self.get_load())[0]["num_waiting_reqs"] == 0:
            await asyncio.sleep(0.01)
        await self.abort(abort_all=True)
        await self.continue_generation()
        return await task


def test_aborted_mid_rollout_then_resumed(engine):
    _, tokenizer = engine
    s = run_hook(engine, "Q1 ", client_cls=AbortSecondTurn)
    check_layout(s)
    assert segments(s, tokenizer) == [(1, "<calc>12*(3+4)</calc>"), (0, "<result>84</result>")]
    assert (s.status, s.metadata["tool_calls"]) == (Status.ABORTED, 1)
    s.status = Status.PENDING  # the buffer recycles it (rollout.partial_rollout)
    resumed = run_hook(engine, "Q1 ", sample=s)
    check_layout(resumed)
    straight = run_hook(engine, "Q1 ")
    assert resumed.tokens == straight.tokens and resumed.loss_mask == straight.loss_mask
    assert (resumed.status, resumed.metadata["tool_calls"]) == (Status.COMPLETED, 2)
