"""RewardScorer: concurrency, group rewards, and the remote reward against a real HTTP server."""

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from aiohttp import web

from slime_hydra.reward import RemoteRewardError, RewardScorer, get_reward_fn, group_reward, scalar_reward
from slime_hydra.reward.config import RewardConfig

CALLS = {"group": 0}


def slow(response, label, metadata):
    time.sleep(0.2)
    return 1.0


@group_reward
def ranked(responses, labels, metadatas):
    CALLS["group"] += 1
    order = sorted(range(len(responses)), key=lambda i: len(responses[i]))
    return [float(order.index(i)) for i in range(len(responses))]


async def test_slow_rule_rewards_run_concurrently():
    scorer = RewardScorer(RewardConfig(name="custom", target="tests.reward.test_scorer.slow", max_concurrency=16))
    start = time.monotonic()
    rewards = await scorer.score_group(["x"] * 16, [None] * 16, [{}] * 16)
    assert rewards == [1.0] * 16 and time.monotonic() - start < 1.6   # 16 x 0.2 s one after another = 3.2 s


async def test_group_reward_is_called_once_per_group():
    CALLS["group"] = 0
    scorer = RewardScorer(RewardConfig(name="custom", target="tests.reward.test_scorer.ranked"))
    out = await scorer.score_batch([(["ccc", "a", "bb"], [None] * 3, [{}] * 3), (["x", "yy"], [None] * 2, [{}] * 2)])
    assert out == [[2.0, 0.0, 1.0], [0.0, 1.0]] and CALLS["group"] == 2


def test_math_reward_is_right_from_many_threads():
    fn = get_reward_fn("math")
    cases = [(f"\\boxed{{\\frac{{{i}}}{{2}}}}", str(i / 2), 1.0) for i in range(1, 41)]
    cases += [(f"\\boxed{{{i + 1}}}", str(i), 0.0) for i in range(40)]
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda c: fn(c[0], c[1], {}), cases))
    assert got == [c[2] for c in cases]


class Server:
    """A reward server on 127.0.0.1 that fails the first `failures` requests with HTTP 500, or sleeps."""

    def __init__(self, failures: int = 0, sleep_s: float = 0.0, reply=None):
        self.failures, self.sleep_s, self.reply, self.requests = failures, sleep_s, reply, 0

    async def handle(self, request):
        self.requests += 1
        body = await request.json()
        if self.requests <= self.failures:
            return web.Response(status=500, text="busy")
        await asyncio.sleep(self.sleep_s)
        reply = self.reply if self.reply is not None else float(body["response"] == body["label"])
        return web.json_response(reply)

    async def __aenter__(self):
        app = web.Application()
        app.router.add_post("/score", self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/score"
        return self

    async def __aexit__(self, *exc):
        await self.runner.cleanup()


def remote(url, **kw) -> RewardScorer:
    return RewardScorer(RewardConfig(name="remote", url=url, backoff_s=0.01, **kw))


async def test_remote_retries_then_succeeds():
    async with Server(failures=2) as server:
        assert await remote(server.url, max_retries=3).score_group(["a"], ["a"], [{}]) == [1.0]
        assert server.requests == 3


async def test_remote_gives_up_after_the_last_retry_naming_url_and_attempts():
    async with Server(failures=100) as server:
        with pytest.raises(RemoteRewardError, match=rf"{server.url}: 3 attempts failed .*; last error: .*500"):
            await remote(server.url, max_retries=2).score_group(["a"], ["a"], [{}])
        assert server.requests == 3


async def test_remote_timeout_counts_as_a_failure():
    async with Server(sleep_s=1.0) as server:
        start = time.monotonic()
        with pytest.raises(RemoteRewardError, match="TimeoutError"):
            await remote(server.url, max_retries=1, timeout_s=0.2).score_group(["a"], ["a"], [{}])
        assert time.monotonic() - start < 0.9


async def test_remote_dict_and_wrapped_replies():
    async with Server(reply={"score": 1.0, "acc": True}) as server:
        assert await remote(server.url).score_group(["a"], ["b"], [{}]) == [{"score": 1.0, "acc": True}]
    async with Server(reply={"reward": 0.25}) as server:
        assert await remote(server.url).score_group(["a"], ["b"], [{}]) == [0.25]


async def test_remote_reply_that_is_not_a_reward_fails_clearly():
    async with Server(reply=["not", "a", "reward"]) as server:
        with pytest.raises(RemoteRewardError, match="not a reward"):
            await remote(server.url, max_retries=0).score_group(["a"], ["b"], [{}])
        assert server.requests == 1


async def test_remote_backoff_doubles():
    async with Server(failures=3) as server:
        start = time.monotonic()
        scorer = RewardScorer(RewardConfig(name="remote", url=server.url, max_retries=3, backoff_s=0.1))
        assert await scorer.score_group(["a"], ["a"], [{}]) == [1.0]
        # waits of ~0.1, 0.2, 0.4 s, each within the jitter of net.backoff_s (+-25%)
        assert server.requests == 4 and time.monotonic() - start >= 0.75 * (0.1 + 0.2 + 0.4)
        await scorer.close()


def test_remote_needs_a_url():
    with pytest.raises(ValueError, match="reward.url"):
        RewardScorer(RewardConfig(name="remote"))




def hangs(response, label, metadata):
    time.sleep(1.0)
    return 1.0


@group_reward
def group_hangs(responses, labels, metadatas):
    time.sleep(1.0)
    return [1.0] * len(responses)


async def test_a_sync_reward_past_timeout_scores_zero():
    scorer = RewardScorer(RewardConfig(name="custom", target="tests.reward.test_scorer.hangs", timeout_s=0.1))
    assert await scorer.score_group(["a", "b"], [None] * 2, [{}] * 2) == [0.0, 0.0] and scorer.timeouts == 2
    group = RewardScorer(RewardConfig(name="custom", target="tests.reward.test_scorer.group_hangs", timeout_s=0.1))
    assert await group.score_group(["a", "b", "c"], [None] * 3, [{}] * 3) == [0.0] * 3 and group.timeouts == 1


async def coroutine_reward(response, label, metadata):
    await asyncio.sleep(0.2)
    return {"score": float(response == label), "acc": response == label}


async def test_async_custom_reward_runs_on_the_loop_concurrently():
    scorer = RewardScorer(RewardConfig(name="custom", target="tests.reward.test_scorer.coroutine_reward",
                                       max_concurrency=8))
    start = time.monotonic()
    out = await scorer.score_batch([(["a", "b"], ["a", "a"], [{}, {}])] * 4)
    assert time.monotonic() - start < 0.6 and out == [[{"score": 1.0, "acc": True}, {"score": 0.0, "acc": False}]] * 4


async def test_max_concurrency_bounds_calls_in_flight():
    scorer = RewardScorer(RewardConfig(name="custom", target="tests.reward.test_scorer.slow", max_concurrency=2))
    start = time.monotonic()
    await scorer.score_group(["x"] * 4, [None] * 4, [{}] * 4)
    assert time.monotonic() - start >= 0.4                           # 4 calls of 0.2 s, two at a time


@group_reward
def wrong_length(responses, labels, metadatas):
    return [1.0]


async def test_group_reward_of_the_wrong_length_is_an_error():
    scorer = RewardScorer(RewardConfig(name="custom", target="tests.reward.test_scorer.wrong_length"))
    with pytest.raises(ValueError, match="returned 1 rewards for 2 responses"):
        await scorer.score_group(["a", "b"], [None] * 2, [{}] * 2)


def test_dapo_scorer_gives_dicts_and_scalar_reward_reads_the_key():
    scorer = RewardScorer(RewardConfig(name="dapo", reward_key="score"))
    out = asyncio.run(scorer.score_group(["Answer: 4", "Answer: 5"], ["4", "4"], [{}, {}]))
    assert [scalar_reward(r, "score") for r in out] == [1.0, -1.0]


def test_scalar_reward():
    assert scalar_reward(0.5) == 0.5 and scalar_reward(1) == 1.0 and scalar_reward({"score": -1.0}, "score") == -1.0
    with pytest.raises(KeyError, match="reward.reward_key=None"):
        scalar_reward({"score": 1.0})
    with pytest.raises(KeyError, match=r"keys \['acc', 'score'\] and reward.reward_key='reward'"):
        scalar_reward({"score": 1.0, "acc": True}, "reward")
