"""The reference policy without a second device copy: host copies of this rank's shards, swapped in on demand.

    ref = host_copy(live)                    # at start: the initial weights, on the host
    with swapped_in(live, ref): forward()    # the reference forward; the trained shards are restored after
"""

from contextlib import contextmanager

import torch


def host_copy(shards: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached host copies of the named tensors."""
    return {name: t.detach().to("cpu", copy=True) for name, t in shards.items()}


@contextmanager
def swapped_in(live: dict[str, torch.Tensor], shards: dict[str, torch.Tensor]):
    """Copy ``shards`` into the live parameter tensors for the duration of the block, then restore them."""
    trained = host_copy(live)
    with torch.no_grad():
        for name, ref in shards.items():
            live[name].copy_(ref)
    try:
        yield
    finally:
        with torch.no_grad():
            for name, mine in trained.items():
                live[name].copy_(mine)
