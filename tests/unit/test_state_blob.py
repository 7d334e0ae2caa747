"""The state blob: safetensors + JSON metadata, read back exactly, and nothing else accepted."""

from __future__ import annotations

import json

import pytest
import safetensors.torch
import torch

from diloco_p2p.swarm.state.codec import StateError, pack_state, unpack_state


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "params/embed.weight": torch.randn(64, 16, generator=g),
        "params/norm.weight": torch.ones(16),
        "momentum/embed.weight": torch.randn(64, 16, generator=g),
        "inner/step": torch.tensor([12], dtype=torch.int64),
        "inner/exp_avg_sq": torch.rand(8, 3, generator=g).t(),  # non-contiguous: stored as is
        "half": torch.randn(5, generator=g).to(torch.bfloat16),
    }


META = {"round": 7, "tokens": 123456, "config_hash": "ab" * 32, "names": ["a", "b"]}


def test_round_trip_keeps_tensors_and_meta_exactly():
    tensors = _tensors()
    out, meta = unpack_state(pack_state(tensors, META))
    assert meta == META
    assert set(out) == set(tensors)
    for name, t in tensors.items():
        assert out[name].dtype == t.dtype and out[name].shape == t.shape
        assert torch.equal(out[name], t), name


def test_packing_is_deterministic_so_agreeing_donors_announce_the_same_hash():
    a = pack_state(_tensors(), META)
    b = pack_state(dict(reversed(list(_tensors().items()))), dict(reversed(list(META.items()))))
    assert a == b


@pytest.mark.parametrize("cut", [0, 3, 8, 40, -1, -100])
def test_truncated_blob_is_a_state_error(cut):
    blob = pack_state(_tensors(), META)
    with pytest.raises(StateError):
        unpack_state(blob[:cut])


@pytest.mark.parametrize(
    "garbage",
    [b"", b"\x00" * 64, b"not a state at all, just text" * 10, (10).to_bytes(8, "little") + b"{not json}",
     (2).to_bytes(8, "little") + b"[]" + b"x" * 16],
)
def test_garbage_is_a_state_error(garbage):
    with pytest.raises(StateError):
        unpack_state(garbage)


def test_safetensors_without_our_metadata_is_refused():
    plain = safetensors.torch.save({"w": torch.zeros(3)})
    with pytest.raises(StateError, match="no 'diloco' entry"):
        unpack_state(plain)
    not_object = safetensors.torch.save({"w": torch.zeros(3)}, metadata={"diloco": json.dumps([1, 2])})
    with pytest.raises(StateError, match="not a JSON object"):
        unpack_state(not_object)


def test_header_that_lies_about_tensor_offsets_is_refused():
    blob = bytearray(pack_state({"w": torch.zeros(4)}, {"round": 1}))
    n = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8 : 8 + n])
    header["w"]["data_offsets"] = [0, 1 << 20]  # points past the end of the buffer
    raw = json.dumps(header).encode()
    forged = len(raw).to_bytes(8, "little") + raw + bytes(blob[8 + n :])
    with pytest.raises(StateError, match="do not load"):
        unpack_state(forged)


def test_meta_must_be_plain_json():
    with pytest.raises(ValueError):
        pack_state({"w": torch.zeros(1)}, {"loss": float("nan")})
    with pytest.raises(TypeError):
        pack_state({"w": torch.zeros(1)}, {"when": object()})
    with pytest.raises(TypeError):
        pack_state({"w": torch.zeros(1)}, [("round", 1)])  # type: ignore[arg-type]


def test_state_error_is_a_value_error_with_a_one_line_message():
    with pytest.raises(ValueError) as e:
        unpack_state(b"\x01\x02")
    assert "\n" not in str(e.value) and "truncated" in str(e.value)
