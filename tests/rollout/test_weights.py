"""Weight-transfer helpers: the tensor payload format, dtype names, request validation before any broadcast."""

import pytest
import torch

from slime_hydra.weight_transport import (
    decode_named_tensors, dtype_from_name, dtype_name, encode_named_tensors, recv_named_tensors,
)


def test_payload_round_trip_keeps_names_dtypes_values():
    named = {"a.weight": torch.randn(3, 4), "b.bias": torch.randn(5).to(torch.bfloat16),
             "c.steps": torch.arange(6, dtype=torch.int64).reshape(2, 3)[:, 1:]}  # non-contiguous
    back = decode_named_tensors(encode_named_tensors(named))
    assert set(back) == set(named)
    for name, tensor in named.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor)
    assert decode_named_tensors(encode_named_tensors(list(named.items())).encode().decode()).keys() == back.keys()


@pytest.mark.parametrize("payload", ["not base64!", "aGVsbG8="])
def test_malformed_payload_is_a_value_error(payload):
    with pytest.raises(ValueError, match="base64 safetensors"):
        decode_named_tensors(payload)


def test_dtype_names():
    assert dtype_name(torch.bfloat16) == "bfloat16"
    assert dtype_from_name("bfloat16") is torch.bfloat16 and dtype_from_name("torch.float16") is torch.float16
    with pytest.raises(ValueError, match="unknown dtype"):
        dtype_from_name("float17")
    with pytest.raises(ValueError, match="unknown dtype"):
        dtype_from_name("nn")


def test_receive_checks_the_request_before_any_broadcast():
    # group=None would fail at the first broadcast: these errors come first.
    with pytest.raises(ValueError, match="differ in length"):
        recv_named_tensors(None, ["a", "b"], ["float32"], [[1], [2]])
    with pytest.raises(ValueError, match="repeat"):
        recv_named_tensors(None, ["a", "a"], ["float32", "float32"], [[1], [2]])
    with pytest.raises(ValueError, match="unknown dtype"):
        recv_named_tensors(None, ["a"], ["float99"], [[1]])
