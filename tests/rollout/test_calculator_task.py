"""The calculator environment through the calculator hook: a policy that calls the tool as the warm start teaches
it gets reward 1 from the task's own score, and the tool, not the policy, writes the result tokens."""

import asyncio

import pytest

from slime_hydra.buffer.sample import Sample
from slime_hydra.data.tasks import get_env, task_reward
from slime_hydra.model.tiny import build_tiny_tokenizer
from slime_hydra.rollout.config import RolloutConfig
from slime_hydra.rollout.generate import RolloutContext
from slime_hydra.rollout.examples.calculator_tool import CALL_CLOSE, calculator_generate


class ScriptedClient:
    """Answers each /generate with the next turn of a script, as an engine stopping at ``</calc>`` would."""

    def __init__(self, tokenizer, turns: list[str]):
        self.tokenizer, self.turns = tokenizer, list(turns)

    async def generate(self, tokens, params, return_logprob=False):
        text = self.turns.pop(0)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        matched = CALL_CLOSE if text.endswith(CALL_CLOSE) else self.tokenizer.eos_token_id
        if matched != CALL_CLOSE:
            ids = ids + [self.tokenizer.eos_token_id]
        return {"output_ids": ids, "text": text, "meta_info": {
            "output_token_logprobs": [[-0.5, i, None] for i in ids], "weight_version": 0,
            "finish_reason": {"type": "stop", "matched": matched}}}


@pytest.mark.parametrize("level", range(1, 7))
def test_a_tool_using_answer_scores_one_and_a_guess_zero(level):
    tokenizer = build_tiny_tokenizer()
    env = get_env("calculator")
    row = env.draw(seed=0, index=level, level=level)
    expression, label = row["metadata"]["expression"], row["label"]

    def run(turns: list[str]) -> Sample:
        sample = Sample(prompt=row["prompt"], label=label, metadata=dict(row["metadata"]),
                        tokens=tokenizer.encode(row["prompt"], add_special_tokens=False))
        ctx = RolloutContext(RolloutConfig(), ScriptedClient(tokenizer, turns), tokenizer, max_context_tokens=256)
        return asyncio.run(calculator_generate(ctx, sample, {"max_new_tokens": 128}))

    used = run([f"<calc>{expression}</calc>", label])
    assert used.response == env.solution(label, row["metadata"]) and used.metadata["tool_calls"] == 1
    assert task_reward(used.response, used.label, used.metadata) == 1.0
    tool_tokens = len(f"<result>{label}</result>")
    assert used.loss_mask.count(0) == tool_tokens                     # the result came from the tool
    guess = run([str(int(label) + 1)])
    assert guess.metadata["tool_calls"] == 0 and task_reward(guess.response, guess.label, guess.metadata) == 0.0
