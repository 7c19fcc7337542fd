"""Compact binary encodings for the per-token arrays of a sample.

One model call produces prompt token ids, completion token ids, behaviour logprobs and routes
(the top-k expert ids per MoE layer for every token). They are stored as little-endian blobs:

- token ids: uint32 (`<u4`), exactly as generated; never re-rendered from text;
- logprobs: float32 (`<f4`);
- routes: an array [T, L, k] stored as uint8 when every id fits in 0..255 (models with at most
  256 experts), else int16 (`<i2`); the dtype name and shape live in separate columns.

This module only converts between Python/numpy/torch values and bytes. It knows nothing about
SQLite; the store decides where the bytes go.
"""

from __future__ import annotations

from typing import Any

import numpy as np

IDS_DTYPE = np.dtype("<u4")
LOGPROBS_DTYPE = np.dtype("<f4")
ROUTES_DTYPES = {"uint8": np.dtype("u1"), "int16": np.dtype("<i2")}


def _to_numpy(value: Any) -> np.ndarray:
    """An ndarray view of a list, ndarray or torch tensor (moved to the CPU first)."""
    if hasattr(value, "detach"):                 # torch.Tensor, without importing torch
        value = value.detach().cpu().numpy()
    return np.asarray(value)


def encode_ids(ids: Any) -> bytes:
    """Token ids -> uint32 little-endian bytes. ValueError for ids outside 0..2**32-1."""
    arr = _to_numpy(ids)
    if arr.size == 0:
        return b""
    if arr.ndim != 1:
        raise ValueError(f"token ids must be a flat sequence, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise ValueError(f"token ids must be integers, got dtype {arr.dtype}")
    if int(arr.min()) < 0 or int(arr.max()) > 0xFFFFFFFF:
        raise ValueError("token ids must lie in 0..2**32-1")
    return arr.astype(IDS_DTYPE, copy=False).tobytes()


def decode_ids(blob: bytes | None) -> list[int]:
    """uint32 little-endian bytes -> list of Python ints."""
    return np.frombuffer(blob or b"", dtype=IDS_DTYPE).tolist()


def encode_logprobs(logprobs: Any) -> bytes:
    """Per-token logprobs -> float32 little-endian bytes."""
    arr = _to_numpy(logprobs)
    if arr.size == 0:
        return b""
    if arr.ndim != 1:
        raise ValueError(f"logprobs must be a flat sequence, got shape {arr.shape}")
    return arr.astype(LOGPROBS_DTYPE, copy=False).tobytes()


def decode_logprobs(blob: bytes | None) -> list[float]:
    """float32 little-endian bytes -> list of Python floats (float32 precision)."""
    return np.frombuffer(blob or b"", dtype=LOGPROBS_DTYPE).tolist()


def routes_dtype_for(routes: np.ndarray) -> str:
    """"uint8" when all ids fit 0..255, else "int16"; ValueError beyond int16."""
    if routes.size == 0:
        return "uint8"
    lo, hi = int(routes.min()), int(routes.max())
    if lo >= 0 and hi < 256:
        return "uint8"
    if lo >= -32768 and hi <= 32767:
        return "int16"
    raise ValueError(f"expert ids must fit in int16, got range {lo}..{hi}")


def encode_routes(routes: Any) -> tuple[bytes, str, tuple[int, int, int]] | None:
    """Routes [T, L, k] (list, ndarray or tensor) -> (bytes, dtype name, shape), or None.

    A leading batch dimension of 1 ([1, T, L, k]) is dropped; an empty value becomes shape
    (0, 0, 0).
    """
    if routes is None:
        return None
    arr = _to_numpy(routes)
    if arr.ndim == 4 and arr.shape[0] == 1:
        arr = arr[0]
    if arr.size == 0 and arr.ndim != 3:
        arr = arr.reshape(0, 0, 0)
    if arr.ndim != 3:
        raise ValueError(f"routes must have shape [T, L, k], got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise ValueError(f"routes must be integer expert ids, got dtype {arr.dtype}")
    name = routes_dtype_for(arr)
    data = np.ascontiguousarray(arr, dtype=ROUTES_DTYPES[name]).tobytes()
    return data, name, (int(arr.shape[0]), int(arr.shape[1]), int(arr.shape[2]))


def decode_routes(blob: bytes | None, dtype: str | None,
                  shape: tuple[int, int, int] | None) -> np.ndarray | None:
    """Bytes + dtype name + shape -> ndarray [T, L, k] (uint8 or int16), or None."""
    if dtype is None or shape is None:
        return None
    arr = np.frombuffer(blob or b"", dtype=ROUTES_DTYPES[dtype])
    return arr.reshape(shape).copy()           # writable, detached from the row's bytes
