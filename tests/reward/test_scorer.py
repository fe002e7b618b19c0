"""RewardScorer: concurrency, group rewards, and the remote reward against a real HTTP server."""

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from aiohttp import web

from slime_hydra.reward import RemoteRewardError, RewardScorer, get_reward_fn, group_reward
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
        with pytest.raises(RemoteRewardError, match=rf"{server.url}: 3 attempts failed; last error: .*500"):
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


def test_remote_needs_a_url():
    with pytest.raises(ValueError, match="reward.url"):
        RewardScorer(RewardConfig(name="remote"))


