"""The delta codec: bit-exact round trips, and every damaged or misdirected delta rejected."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from agent_runtime import delta

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.int8, torch.bool]
SETTINGS = settings(max_examples=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def random_tensor(rng: np.random.Generator, shape, dtype) -> torch.Tensor:
    n = int(np.prod(shape, dtype=np.int64))
    size = torch.empty(0, dtype=dtype).element_size()
    words = rng.integers(0, 2 if dtype == torch.bool else 256, size=n * size, dtype=np.uint8)
    if dtype.is_floating_point:   # realistic weights, not NaN payloads
        return torch.from_numpy(rng.normal(0, 0.02, size=n).astype(np.float32)).to(dtype).reshape(shape)
    return torch.from_numpy(words).view(dtype).reshape(shape).clone()


@st.composite
def state_pairs(draw):
    """(old, new): random tensors, then sparse / dense / no changes, renames and reshapes."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    old = {}
    for i in range(draw(st.integers(1, 5))):
        shape = draw(st.lists(st.integers(0, 40), min_size=0, max_size=3))
        old[f"layers.{i}.w"] = random_tensor(rng, shape, draw(st.sampled_from(DTYPES)))
    new = {}
    for name, t in old.items():
        change = draw(st.sampled_from(["none", "sparse", "dense", "steps", "drop", "reshape"]))
        words = t.reshape(-1).clone()
        if change == "drop":
            continue
        if change == "reshape":
            new[name] = random_tensor(rng, [t.numel() + 1], t.dtype)
            continue
        if change == "steps" and t.dtype != torch.bool:   # optimizer-like: a few units
            new[name] = step_words(rng, t, draw(st.sampled_from([0.02, 0.9])))
            continue
        if change != "none" and t.numel():
            frac = 0.02 if change == "sparse" else 0.9
            mask = torch.from_numpy(rng.random(t.numel()) < frac)
            fresh = random_tensor(rng, [t.numel()], t.dtype)
            words[mask] = fresh[mask]
        new[name] = words.reshape(t.shape)
    if draw(st.booleans()):
        new["added"] = random_tensor(rng, [7, 3], torch.float32)
    return old, new


def step_words(rng: np.random.Generator, t: torch.Tensor, frac: float) -> torch.Tensor:
    """`t` with a share `frac` of its raw words moved by -3..3 units (wrapping around)."""
    words = delta._words(t).copy()
    mask = rng.random(words.size) < frac
    words[mask] += rng.integers(-3, 4, size=int(mask.sum())).astype(words.dtype)
    return torch.from_numpy(words.view(np.int8 if words.itemsize == 1 else f"i{words.itemsize}")
                            ).view(t.dtype).reshape(t.shape)


def copy_state(state):
    return {k: v.clone() for k, v in state.items()}


def assert_same(a, b):
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert np.array_equal(delta._words(a[k]), delta._words(b[k])), k   # bitwise


@SETTINGS
@given(state_pairs())
def test_round_trip_is_bit_exact(pair):
    old, new = pair
    before = delta.state_sha256(old)
    blob = delta.encode(old, new, from_version=3, to_version=4)
    out = delta.apply(old, blob)
    assert_same(out, new)
    assert delta.state_sha256(out) == delta.state_sha256(new)
    assert delta.state_sha256(old) == before


@SETTINGS
@given(state_pairs())
def test_in_place_apply_matches_functional_apply(pair):
    old, new = pair
    target = copy_state(old)
    patch = delta.apply_(target, delta.encode(old, new))
    assert_same(target, new)
    assert patch.sha256 == delta.state_sha256(new)
    assert patch.digests == delta.tensor_digests(new)


def small_pair(seed=0):
    rng = np.random.default_rng(seed)
    old = {"embed": random_tensor(rng, [300, 64], torch.bfloat16),
           "experts.0.up": random_tensor(rng, [64, 128], torch.bfloat16),
           "norm": random_tensor(rng, [64], torch.float32)}
    new = copy_state(old)
    new["embed"].view(-1)[::97] += 0.01
    new["experts.0.up"] += 1e-3
    new["norm"][3] = 2.0
    return old, new


def test_small_steps_are_coded_as_steps_even_across_wraparound():
    rng = np.random.default_rng(0)
    old = {"w": random_tensor(rng, [4096], torch.bfloat16)}
    words = delta._words(old["w"])
    words[:4] = [0, 0xFFFF, 0x7FFF, 0x8000]         # steps below will wrap these around
    new = {"w": step_words(rng, old["w"], 0.05)}
    delta._words(new["w"])[:4] = [0xFFFF, 0, 0x8000, 0x7FFF]
    blob = delta.encode(old, new)
    (section,) = delta.read_header(blob)["tensors"][0]["sections"]
    assert section["values"] == "diff"
    assert_same(delta.apply(old, blob), new)


def test_one_thread_gives_the_same_delta():
    old, new = small_pair()
    blob = delta.encode(old, new, threads=1)
    assert blob == delta.encode(old, new)
    target = copy_state(old)
    delta.apply_(target, blob, threads=1)
    assert_same(target, new)


def test_header_carries_versions_and_hashes():
    old, new = small_pair()
    header = delta.read_header(delta.encode(old, new, from_version=7, to_version=9))
    assert (header["from_version"], header["to_version"]) == (7, 9)
    assert header["base_sha256"] == delta.state_sha256(old)
    assert header["target_sha256"] == delta.state_sha256(new)


def test_unchanged_state_gives_a_tiny_delta():
    old, _ = small_pair()
    blob = delta.encode(old, copy_state(old))
    assert len(blob) < 400
    assert_same(delta.apply(old, blob), old)


def test_sha256_depends_on_names_dtypes_and_shapes():
    t = torch.arange(12, dtype=torch.int16)
    shas = {delta.state_sha256({"a": t}), delta.state_sha256({"b": t}),
            delta.state_sha256({"a": t.reshape(3, 4)}),
            delta.state_sha256({"a": t.view(torch.float16)})}
    assert len(shas) == 4


def test_multi_block_tensor_only_sends_changed_blocks():
    n = delta.BLOCK_BYTES // 2 + 1000                     # bf16: two blocks
    old = {"big": torch.zeros(n, dtype=torch.bfloat16)}
    new = copy_state(old)
    new["big"][-5:] = 1.0
    blob = delta.encode(old, new)
    (entry,) = delta.read_header(blob)["tensors"]
    assert [s["block"] for s in entry["sections"]] == [1]
    assert len(blob) < 1000
    patch = delta.prepare(old, blob, digests=delta.tensor_digests(old))
    target = copy_state(old)
    patch.commit(target)
    assert_same(target, new)


def test_in_place_apply_on_a_module():
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4)).to(torch.bfloat16)
    old = copy_state(model.state_dict())
    new = copy_state(old)
    new["0.weight"][0, :3] += 0.5
    delta.apply_(model, delta.encode(old, new))
    assert_same(copy_state(model.state_dict()), new)


def test_snapshot_replacement_patch():
    old, new = small_pair()
    target = copy_state(old)
    delta.Patch.replacement(new, sha256=delta.state_sha256(new)).commit(target)
    assert_same(target, new)
    with pytest.raises(delta.DeltaError, match="snapshot hash"):
        delta.Patch.replacement(new, sha256=delta.state_sha256(old))


# --------------------------------------------------------------------- rejection

def rejected(old, blob, match=None):
    """`blob` must raise DeltaError in apply and apply_, leaving the state untouched."""
    before = delta.state_sha256(old)
    with pytest.raises(delta.DeltaError, match=match):
        delta.apply(old, blob)
    with pytest.raises(delta.DeltaError, match=match):
        delta.apply_(old, blob)
    assert delta.state_sha256(old) == before


BLOB_PAIR = small_pair()
BLOB = delta.encode(*BLOB_PAIR, from_version=1, to_version=2)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, len(BLOB) - 1), st.integers(1, 255))
def test_any_flipped_byte_is_rejected(pos, xor):
    damaged = bytearray(BLOB)
    damaged[pos] ^= xor
    rejected(BLOB_PAIR[0], bytes(damaged))


@settings(max_examples=40, deadline=None)
@given(st.integers(0, len(BLOB) - 1))
def test_any_truncation_is_rejected(length):
    rejected(BLOB_PAIR[0], BLOB[:length])


def test_trailing_bytes_are_rejected():
    rejected(BLOB_PAIR[0], BLOB + b"\0", match="trailing")


def test_reordered_sections_are_rejected():
    header = delta.read_header(BLOB)
    sections = sorted((s for e in header["tensors"] for s in e.get("sections", [])),
                      key=lambda s: s["offset"])
    assert len(sections) >= 2
    base = header["payload_offset"]
    parts = [BLOB[base + s["offset"]:base + s["offset"] + s["length"]] for s in sections]
    reordered = BLOB[:base] + b"".join(parts[::-1])
    assert len(reordered) == len(BLOB) and reordered != BLOB
    rejected(BLOB_PAIR[0], reordered, match="checksum")


def test_wrong_base_is_rejected_with_a_clear_message():
    old, new = BLOB_PAIR
    rejected(new, BLOB, match="wrong base")
    other = copy_state(old)
    other["norm"][0] += 1
    rejected(other, BLOB, match="wrong base")


def test_in_place_apply_into_a_mismatched_model_touches_nothing():
    old, new = BLOB_PAIR
    patch = delta.prepare(old, BLOB)
    model = torch.nn.Linear(2, 2)
    before = delta.state_sha256(model)
    with pytest.raises(delta.DeltaError):
        patch.commit(model)
    assert delta.state_sha256(model) == before


def test_not_a_delta_is_rejected():
    rejected(BLOB_PAIR[0], b"hello world, this is not a delta", match="magic")
