"""Weight-transfer helpers shared by the trainer side (train/weight_sync.py, the sender) and the engines (the
embedded engine and the rollout manager's replay, the receivers).

``buckets`` cuts a stream of named tensors into requests of bounded size. Two transports move a trainer's weights into running engines without going through disk:

- **distributed**: the trainer's rank 0 and every engine join one extra process group (``init_weight_update_group``;
  trainer rank 0, engine ranks ``rank_offset + i``), then the trainer broadcasts each tensor from rank 0 in the order
  named in the engine's ``/update_weights_from_distributed`` request (``send_named_tensors`` / ``recv_named_tensors``).
  The group is built on a TCPStore at ``master_address:master_port`` (hosted by rank 0, listening on that address
  alone: ``net.tcp_store``) wrapped in ``PrefixStore(group_name)`` and torch's process-group helper, which is the
  layout SGLang engines use, so one trainer-side code path serves both engine kinds. gloo on CPU, nccl on GPU.
- **tensor payload**: ``/update_weights_from_tensor`` carries ``serialized_named_tensors``, a list with one string per
  engine tensor-parallel rank (the embedded engine has one). Here each string is the base64 text of a safetensors
  blob (``encode_named_tensors``): portable, no pickle, so nothing in a request can run code. Real SGLang expects its
  own serialisation (CUDA IPC handles of a colocated trainer) in that field; this format is the embedded engine's.
- **CUDA IPC** (``load_format: "cuda_ipc"``, the colocated path on GPUs): the trainer copies a bucket into one flat
  device buffer and sends only a handle to it (``share_cuda_bucket``): JSON with the buffer's CUDA IPC handle, the
  GPU's UUID and each tensor's name, dtype, shape and byte offset. The engine on the same GPU opens the handle
  (``open_cuda_bucket``) and copies device to device; nothing travels through the host. One entry per trainer GPU
  may be given; an engine takes the one whose UUID is its own GPU's (device indices differ between processes
  with different ``CUDA_VISIBLE_DEVICES``, UUIDs do not). The sender must keep the buffer alive until the
  request returns. JSON, not pickle, so a request still cannot run code.

LoRA adapters (train.lora with adapter sync) travel by any of these under PEFT's saved-adapter keys
(``adapter_key``: ``base_model.model.<HF module>.lora_A.weight`` / ``lora_B``), the names a PEFT adapter directory
holds; an engine that applies adapters maps them onto its own modules (``split_adapter_key``).

Dtype names travel as torch's names without the ``torch.`` prefix (``bfloat16``); both spellings are accepted.

Sockets: gloo binds to the address the hostname resolves to and NCCL to the first non-loopback interface (unless
``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` say otherwise); in containers either can be an address the peers
cannot reach. A loopback master address means the whole group is on one host, so then (and only when those
variables are unset) the group is built on the loopback interface; NCCL connects eagerly, while the choice is in
force. Multi-host groups keep the library defaults: set those variables as for any gloo/NCCL job.
"""

import base64
import ipaddress
import json
import os
import socket
from contextlib import contextmanager
from datetime import timedelta
from typing import Iterable, Iterator, Mapping, Optional, Sequence, Union

import torch
import torch.distributed as dist
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save

from slime_hydra.net import tcp_store

NamedTensors = Union[Mapping[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]]]


ADAPTER_PREFIX = "base_model.model."
"""PEFT's prefix of every key in a saved adapter (the PeftModel -> LoraModel -> HF model nesting)."""


def adapter_key(module: str, which: str) -> str:
    """The saved-adapter key of ``module``'s (HF dotted path) ``which`` ("A" or "B") matrix."""
    return f"{ADAPTER_PREFIX}{module}.lora_{which}.weight"


def split_adapter_key(key: str) -> Optional[tuple[str, str]]:
    """Inverse of ``adapter_key``: (HF module path, "A" | "B"), or None for a key that is not an adapter's."""
    if not key.startswith(ADAPTER_PREFIX) or not key.endswith((".lora_A.weight", ".lora_B.weight")):
        return None
    return key[len(ADAPTER_PREFIX):-len(".lora_A.weight")], key[-len("A.weight")]


def buckets(named: Iterator[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group (name, tensor) pairs in order into lists of at most bucket_bytes (a larger tensor goes alone)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the spelling used in update requests)."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """``"bfloat16"`` or ``"torch.bfloat16"`` -> ``torch.bfloat16``; ValueError for anything that is not a dtype."""
    value = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} (expected a torch dtype name such as 'bfloat16' or 'float32')")
    return value


def _items(named: NamedTensors) -> list[tuple[str, torch.Tensor]]:
    return list(named.items()) if isinstance(named, Mapping) else list(named)


def encode_named_tensors(named: NamedTensors) -> str:
    """Named tensors -> base64 text of one safetensors blob (tensors are copied to CPU, made contiguous)."""
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in _items(named)}
    return base64.b64encode(safetensors_save(tensors)).decode("ascii")


def decode_named_tensors(payload: str) -> dict[str, torch.Tensor]:
    """Inverse of ``encode_named_tensors``; ValueError with the cause when the payload is not such a blob."""
    try:
        return safetensors_load(base64.b64decode(payload, validate=True))
    except Exception as exc:  # binascii.Error, safetensors' SafetensorError: both mean a malformed payload
        raise ValueError(f"serialized_named_tensors entry is not base64 safetensors: {exc}") from exc


IPC_ALIGN = 256
"""Byte alignment of each tensor inside a shared bucket (any dtype can be viewed at such an offset)."""


def gpu_uuid(device: Union[int, torch.device]) -> str:
    """The GPU's UUID as text: the same physical GPU has the same UUID in every process."""
    return str(torch.cuda.get_device_properties(device).uuid)


def share_cuda_bucket(named: NamedTensors) -> tuple[torch.Tensor, dict]:
    """Copy CUDA tensors into one flat uint8 buffer; returns (buffer, handle entry).

    The entry (JSON-safe) is ``{"uuid", "handle", "size", "offset", "ref_counter_handle", "ref_counter_offset",
    "event_handle", "event_sync_required", "tensors": [[name, dtype, shape, byte_offset], ...]}``; bytes fields are
    base64. Keep the returned buffer alive until every engine has loaded from it.
    """
    items = _items(named)
    if not items:
        raise ValueError("share_cuda_bucket needs at least one tensor")
    device = items[0][1].device
    if device.type != "cuda" or any(t.device != device for _, t in items):
        raise ValueError("share_cuda_bucket needs every tensor on one CUDA device")
    layout, total = [], 0
    for name, t in items:
        layout.append([name, dtype_name(t.dtype), list(t.shape), total])
        total += -(-t.numel() * t.element_size() // IPC_ALIGN) * IPC_ALIGN
    flat = torch.empty(total, dtype=torch.uint8, device=device)
    for (_, t), (_, _, _, offset) in zip(items, layout):
        nbytes = t.numel() * t.element_size()
        flat[offset:offset + nbytes].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
    torch.cuda.current_stream(device).synchronize()
    (_, handle, size, offset, rc_handle, rc_offset, event_handle,
     event_sync) = flat.untyped_storage()._share_cuda_()
    b64 = lambda raw: base64.b64encode(raw).decode("ascii") if raw else None  # noqa: E731
    return flat, {"uuid": gpu_uuid(device), "handle": b64(handle), "size": int(size), "offset": int(offset),
                  "ref_counter_handle": b64(rc_handle), "ref_counter_offset": int(rc_offset),
                  "event_handle": b64(event_handle), "event_sync_required": bool(event_sync), "tensors": layout}


def open_cuda_bucket(payload: str, device: Union[str, torch.device]) -> dict[str, torch.Tensor]:
    """Engine side of ``share_cuda_bucket``: payload is the JSON list of entries (one per trainer GPU); opens the
    entry of ``device``'s GPU and returns views of the sender's buffer (valid while the sender keeps it)."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"load_format cuda_ipc needs the engine on a GPU, not {device}")
    try:
        entries = json.loads(payload)
        mine = gpu_uuid(device)
        entry = next((e for e in entries if e["uuid"] == mine), None)
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"serialized_named_tensors entry is not a cuda_ipc handle list: {exc}") from exc
    if entry is None:
        raise ValueError(f"no cuda_ipc handle for this engine's GPU {mine} (handles from "
                         f"{[e.get('uuid') for e in entries]}): CUDA IPC needs trainer and engine on the same GPU; "
                         "use train.weight_sync=distributed when they are not colocated")
    raw = lambda text: base64.b64decode(text) if text else b""  # noqa: E731
    index = device.index if device.index is not None else torch.cuda.current_device()
    storage = torch.UntypedStorage._new_shared_cuda(
        index, raw(entry["handle"]), entry["size"], entry["offset"], raw(entry["ref_counter_handle"]),
        entry["ref_counter_offset"], raw(entry["event_handle"]), entry["event_sync_required"])
    flat = torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", index)).set_(storage)
    out = {}
    for name, dtype, shape, offset in entry["tensors"]:
        dt = dtype_from_name(dtype)
        count = 1
        for s in shape:
            count *= int(s)
        nbytes = count * torch.empty(0, dtype=dt).element_size()
        out[name] = flat[offset:offset + nbytes].view(dt).view([int(s) for s in shape])
    return out


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(address)).is_loopback
    except (OSError, ValueError):
        return False


@contextmanager
def _loopback_sockets(enabled: bool) -> Iterator[None]:
    """Point unset GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME at the loopback interface for the duration."""
    names = [n for _, n in socket.if_nameindex()] if enabled else []
    loopback = next((n for n in names if n == "lo" or n.startswith("lo")), None)
    added = [var for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if loopback and var not in os.environ]
    for var in added:
        os.environ[var] = loopback
    try:
        yield
    finally:
        for var in added:
            os.environ.pop(var, None)


def init_weight_update_group(master_address: str, master_port: int, rank: int, world_size: int,
                             group_name: str = "weight_update_group", backend: str = "gloo",
                             timeout_s: float = 300.0,
                             device: Optional[Union[str, torch.device]] = None) -> dist.ProcessGroup:
    """Join (or, as rank 0, host) the weight-update process group; blocks until all ``world_size`` ranks joined.

    Works with or without a default process group in this process (a trainer rank has one, an engine does not).
    Collectives on the returned group take *group* ranks (the trainer is 0). device: this rank's CUDA device for
    nccl (default: the current one); the NCCL communicator is connected on it before returning.
    """
    # The private helper is what builds a group on an explicit store; SGLang builds its side the same way, and the
    # key layout of the store has to match for the ranks to find each other.
    from torch.distributed.distributed_c10d import _new_process_group_helper, _world

    timeout = timedelta(seconds=timeout_s)
    extra = {}
    if backend == "nccl":
        cuda = torch.device(device) if device is not None else torch.device("cuda")
        if cuda.type != "cuda":
            raise ValueError(f"backend nccl needs a CUDA device, not {cuda}; use gloo on CPU")
        extra["device_id"] = cuda if cuda.index is not None else torch.device("cuda", torch.cuda.current_device())
    with _loopback_sockets(_is_loopback(master_address)):
        store = tcp_store(master_address, master_port, rank, world_size, timeout)
        group, _ = _new_process_group_helper(world_size, rank, [], backend, dist.PrefixStore(group_name, store),
                                             group_name=group_name, timeout=timeout, **extra)
    # Group ranks are global ranks here: this group is not a subset of a default world.
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def destroy_weight_update_group(group: dist.ProcessGroup) -> None:
    """Leave a group made by ``init_weight_update_group``."""
    dist.destroy_process_group(group)


def send_named_tensors(group: dist.ProcessGroup, named: NamedTensors) -> None:
    """Trainer side: broadcast each tensor from group rank 0, in order (the order of the request's ``names``)."""
    for _, tensor in _items(named):
        dist.broadcast(tensor.contiguous(), src=0, group=group)


def recv_named_tensors(group: dist.ProcessGroup, names: Sequence[str], dtypes: Sequence[str],
                       shapes: Sequence[Sequence[int]],
                       device: Union[str, torch.device] = "cpu") -> dict[str, torch.Tensor]:
    """Engine side: receive the tensors rank 0 broadcasts, allocated from the request's names/dtypes/shapes lists."""
    if not (len(names) == len(dtypes) == len(shapes)):
        raise ValueError(f"names/dtypes/shapes differ in length: {len(names)}/{len(dtypes)}/{len(shapes)}")
    if len(set(names)) != len(names):
        raise ValueError("names repeat a tensor name; each broadcast needs its own name")
    # Every buffer is allocated (every dtype checked) before the first broadcast: failing half-way would leave the
    # sender blocked in a broadcast nobody joins.
    received = {name: torch.empty([int(s) for s in shape], dtype=dtype_from_name(dtype), device=device)
                for name, dtype, shape in zip(names, dtypes, shapes)}
    for buffer in received.values():
        dist.broadcast(buffer, src=0, group=group)
    return received
