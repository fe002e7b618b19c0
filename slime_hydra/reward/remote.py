"""A reward server: POST {"response", "label", "metadata"} -> a float, a dict, or {"reward": x}.

Each request has ``reward.timeout_s``; a failure (connection error, timeout, HTTP status >= 400, a body that is
not a reward) is retried ``reward.max_retries`` times, waiting about ``backoff_s``, then twice that, and so on
(``net.backoff_s``: capped, with jitter). After
the last attempt a ``RemoteRewardError`` names the URL, the attempts and the last error: a run does not go on
with rewards silently missing.
"""

import asyncio
from typing import Any, Optional

import aiohttp

from slime_hydra.net import backoff_s


class RemoteRewardError(RuntimeError):
    """The reward server failed every attempt."""


class RemoteReward:
    """``await RemoteReward(url, ...)(response, label, metadata)`` -> float | dict (see the module docstring)."""

    def __init__(self, url: str, timeout_s: float = 30.0, max_retries: int = 3, backoff_s: float = 1.0):
        self.url, self.timeout_s, self.max_retries, self.backoff_s = url, timeout_s, max_retries, backoff_s
        self._session: Optional[aiohttp.ClientSession] = None
        self._session_loop: Optional[asyncio.AbstractEventLoop] = None

    async def __call__(self, response: str, label: Any, metadata: dict) -> float | dict:
        payload = {"response": response, "label": label, "metadata": metadata}
        last: Exception | None = None
        for attempt in range(1 + self.max_retries):
            if attempt:
                await asyncio.sleep(backoff_s(attempt - 1, self.backoff_s))
            try:
                return await self._post(payload)
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as error:
                last = error
        detail = str(last) or f"no reply within reward.timeout_s={self.timeout_s}"
        raise RemoteRewardError(f"reward server {self.url}: {1 + self.max_retries} attempts failed "
                                f"(reward.max_retries={self.max_retries}); last error: {type(last).__name__}: {detail}")

    async def _post(self, payload: dict) -> float | dict:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._session_loop is not loop:
            self._session, self._session_loop = aiohttp.ClientSession(), loop  # a session belongs to one loop
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        async with self._session.post(self.url, json=payload, timeout=timeout) as resp:
            if resp.status >= 400:
                raise ValueError(f"HTTP {resp.status}: {(await resp.text())[:200]}")
            body = await resp.json(content_type=None)
        if isinstance(body, bool) or not isinstance(body, (int, float, dict)):
            raise ValueError(f"the reply is not a reward (a number or a dict): {body!r}")
        if isinstance(body, dict) and set(body) == {"reward"}:
            return float(body["reward"])
        return float(body) if isinstance(body, (int, float)) else body

    async def close(self) -> None:
        if self._session is not None and self._session_loop is asyncio.get_running_loop():
            await self._session.close()
        self._session = None
