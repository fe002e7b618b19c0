"""engine_pool.InFlightLimit: the rollout manager's cap on requests in flight follows the engines in service, so an
engine added mid-run gets its share of requests and a removed one's share is given up. One event loop, no timers:
each step lets every runnable task run (``settle``) before the counts are read."""

import asyncio

from slime_hydra.rollout.engine_pool import InFlightLimit


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


async def test_the_limit_grows_with_added_engines_and_shrinks_with_removed_ones():
    engines = [1]
    limit = InFlightLimit(2, lambda: engines[0])
    done = [asyncio.Event() for _ in range(8)]
    entered = []

    async def request(i: int) -> None:
        async with limit:
            entered.append(i)
            await done[i].wait()

    tasks = [asyncio.create_task(request(i)) for i in range(6)]
    await settle()
    assert entered == [0, 1] and limit.held == 2  # one engine: 2 in flight, 4 wait

    engines[0] = 3  # two engines added: room for 6
    done[0].set()
    await settle()
    assert entered == [0, 1, 2, 3, 4, 5] and limit.held == 5  # the end of one let every waiting one go

    engines[0] = 1  # two removed: room for 2 again
    tasks += [asyncio.create_task(request(6)), asyncio.create_task(request(7))]
    for i in (1, 2, 3):
        done[i].set()
    await settle()
    assert limit.held == 2 and 6 not in entered  # 4 and 5 still run: nothing new until fewer than 2 are in flight

    done[4].set()
    await settle()
    assert entered[-1] == 6 and limit.held == 2 and 7 not in entered
    for event in done:
        event.set()
    await asyncio.gather(*tasks)
    assert sorted(entered) == list(range(8)) and limit.held == 0
