"""Lossless weight deltas between two state dicts: the one codec the learner and runtimes share.

A delta lists, per changed tensor, the changed positions and the values there: the new words
themselves, their XOR with the base words, or the step between the two words (new - old
modulo 2**bits, zigzagged: an optimizer step of one unit in the last place either way becomes
1 or 2), whichever compresses smaller. All are exact integer operations on the raw words, never
float arithmetic, so nothing can drift, and the base hash check means a delta only ever applies
to the one state it was made from. Tensors are cut into blocks of `BLOCK_BYTES`; each changed
block becomes one section, encoded as the smallest of: sparse positions (gap-coded), a bitmap
of positions, or (once half the block changed) a dense XOR or dense step; all byte-planed and
zstd-compressed. Any dtype of 1, 2, 4 or 8 bytes works (bf16 first).

Identity: `state_sha256` is a sha256 over the sorted tensor names, dtypes, shapes and the
raw bytes, hashed as a two-level tree (sha256 of each block, sha256 of the block digests per
tensor) so that hashing runs on all cores and a runtime that caches its block digests only
rehashes the blocks a delta touches.

Verification: `prepare` checks the header hash, every section's crc32, the base state hash,
every changed tensor's digest and the resulting state hash before anything is written;
`Patch.commit` then only copies values in. Any mismatch raises `DeltaError`.

Blob layout: MAGIC, u32 header length, zstd(JSON header), sha256(compressed header),
payload (the sections, at the offsets the header gives).

Not here: where deltas come from or go (learner.versions, learner.server, subscriber), and
chaining deltas without states (the version store encodes old -> new from stored states).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import numpy as np
import torch
import zstandard

MAGIC = b"APDELTA1"
FORMAT = 2                                # 2 added the "diff" value coding; 1 is still read
BLOCK_BYTES = 1 << 24                     # hash/section granularity; part of the identity
ZSTD_LEVEL = 1                            # fastest, and smallest on these streams
_DENSE_FROM = 2                           # try dense XOR once >= 1/2 of a block changed

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_TORCH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int8, torch.uint8,
    torch.int16, torch.int32, torch.int64, torch.bool)}
for _name in ("float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _name):
        _DTYPES[_name] = getattr(torch, _name)

Digests = dict[str, list[bytes]]          # tensor name -> sha256 of each block


class DeltaError(ValueError):
    """A delta that cannot be applied: corrupted, truncated, reordered, or for another base."""


# ---------------------------------------------------------------------------- raw views

def _dtype_name(t: torch.Tensor) -> str:
    name = str(t.dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise TypeError(f"unsupported dtype {t.dtype} (supported: {', '.join(_DTYPES)})")
    return name


def _words(t: torch.Tensor, start: int = 0, stop: int | None = None) -> np.ndarray:
    """Elements [start:stop) of `t` as unsigned words (bf16 -> uint16); zero-copy on CPU."""
    flat = t.detach().reshape(-1)[start:stop]
    if flat.device.type != "cpu":
        flat = flat.cpu()
    size = t.element_size()
    return flat.contiguous().view(_TORCH_INT[size]).numpy().view(_UINT[size])


def _block_elems(itemsize: int) -> int:
    return BLOCK_BYTES // itemsize


def _n_blocks(numel: int, itemsize: int) -> int:
    return max(1, -(-numel // _block_elems(itemsize)))


def _tensors(target: Any) -> Mapping[str, torch.Tensor]:
    return target.state_dict() if isinstance(target, torch.nn.Module) else target


# ---------------------------------------------------------------------------- parallelism

_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(min(32, os.cpu_count() or 1), thread_name_prefix="delta")
        return _POOL


def _parallel(fn: Callable, items: list, sizes: Iterable[int], threads: int | None = None) -> list:
    """`[fn(x) for x in items]`, in order, on the pool; small items batched to ~one block.

    `threads`: None = the shared pool (one thread per core), 1 = in this thread, n = n threads.
    """
    groups, group, weight = [], [], 0
    for item, size in zip(items, sizes):
        group.append(item)
        weight += size
        if weight >= BLOCK_BYTES // 2:
            groups.append(group)
            group, weight = [], 0
    if group:
        groups.append(group)
    if len(groups) <= 1 or threads == 1:
        return [fn(x) for x in items]
    run = lambda g: [fn(x) for x in g]                                   # noqa: E731
    if threads is None:
        results = list(_pool().map(run, groups))
    else:
        with ThreadPoolExecutor(threads, thread_name_prefix="delta") as pool:
            results = list(pool.map(run, groups))
    return [r for batch in results for r in batch]


_LOCAL = threading.local()


def _zc(data: bytes | np.ndarray, level: int, literal: bool = False) -> bytes:
    """zstd at `level`; `literal`: long matches only (min 7 bytes, a tiny search), so that
    near-random small symbols go to the Huffman-coded literals instead of short matches."""
    cache = _LOCAL.__dict__.setdefault("compressors", {})
    if (level, literal) not in cache:
        params = zstandard.ZstdCompressionParameters.from_level(
            level, **({"min_match": 7, "search_log": 1, "hash_log": 6, "chain_log": 6}
                      if literal else {}))
        cache[level, literal] = zstandard.ZstdCompressor(compression_params=params)
    return cache[level, literal].compress(data)


def _zd(data: bytes | memoryview, size: int, what: str) -> bytes:
    if "decompressor" not in _LOCAL.__dict__:
        _LOCAL.decompressor = zstandard.ZstdDecompressor()
    try:
        out = _LOCAL.decompressor.decompress(data, max_output_size=size)
    except zstandard.ZstdError as e:
        raise DeltaError(f"{what}: cannot decompress ({e})") from None
    if len(out) != size:
        raise DeltaError(f"{what}: decompressed to {len(out)} bytes, expected {size}")
    return out


def _planes(words: np.ndarray) -> np.ndarray:
    """Byte-planes: all first bytes, then all second bytes... (zstd likes exponents together)."""
    size = words.dtype.itemsize
    if size == 1:
        return words.view(np.uint8)
    raw = np.ascontiguousarray(words).view(np.uint8).reshape(-1, size)
    out = np.empty((size, raw.shape[0]), np.uint8)
    for i in range(size):                     # one strided pass per plane: faster than .T.copy()
        out[i] = raw[:, i]
    return out


def _zigzag(old: np.ndarray, new: np.ndarray) -> np.ndarray:
    """(new - old) modulo 2**bits, zigzagged (0, -1, 1, -2 ... -> 0, 1, 2, 3 ...): a weight
    that moved a few units in the last place either way becomes a small word."""
    d = new - old
    return (d << 1) ^ (0 - (d >> (8 * d.dtype.itemsize - 1)))


def _unzigzag(old: np.ndarray, z: np.ndarray) -> np.ndarray:
    return old + ((z >> 1) ^ (0 - (z & 1)))


def _unplanes(data: bytes, size: int) -> np.ndarray:
    raw = np.frombuffer(data, np.uint8)
    if size == 1:
        return raw.copy()
    planes = raw.reshape(size, -1)
    out = np.empty((planes.shape[1], size), np.uint8)
    for i in range(size):
        out[:, i] = planes[i]
    return out.view(_UINT[size]).reshape(-1)


# ---------------------------------------------------------------------------- identity

def tensor_digests(state: Any, threads: int | None = None) -> Digests:
    """sha256 of every `BLOCK_BYTES` block of every tensor (a model's state_dict or a dict).

    Blocks are read one at a time, so tensors on an accelerator never sit whole in host memory.
    """
    tensors = _tensors(state)
    items, sizes = [], []
    for name, t in tensors.items():
        _dtype_name(t)
        size, numel = t.element_size(), t.numel()
        block = _block_elems(size)
        for b in range(_n_blocks(numel, size)):
            items.append((name, t, b * block, min((b + 1) * block, numel)))
            sizes.append((items[-1][3] - items[-1][2]) * size)
    digests = _parallel(lambda it: hashlib.sha256(_words(*it[1:])).digest(), items, sizes,
                        threads)
    out: Digests = {name: [] for name in tensors}
    for (name, *_), d in zip(items, digests):
        out[name].append(d)
    return out


def _tensor_digest(blocks: list[bytes]) -> bytes:
    return hashlib.sha256(b"".join(blocks)).digest()


def _state_hash(meta: Mapping[str, tuple[str, list[int]]],
                tensor_digest: Mapping[str, bytes]) -> str:
    h = hashlib.sha256(b"apprentice-state-v1\n")
    for name in sorted(meta):
        dtype, shape = meta[name]
        h.update(json.dumps([name, dtype, list(shape)]).encode() + b"\n" + tensor_digest[name])
    return h.hexdigest()


def _meta(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[str, list[int]]]:
    return {name: (_dtype_name(t), list(t.shape)) for name, t in tensors.items()}


def state_sha256(state: Any, digests: Digests | None = None) -> str:
    """The identity of a policy version: hash of sorted names, dtypes, shapes and raw bytes."""
    tensors = _tensors(state)
    digests = tensor_digests(tensors) if digests is None else digests
    return _state_hash(_meta(tensors), {n: _tensor_digest(digests[n]) for n in tensors})


# ---------------------------------------------------------------------------- encode

def _encode_block(old: np.ndarray, new: np.ndarray, level: int) -> dict:
    """The smallest encoding of one changed block -> section fields plus its payload."""
    changed = old != new
    idx = np.flatnonzero(changed)
    new_values, old_values = new[idx], old[idx]
    steps = _planes(_zigzag(old_values, new_values))
    values = min((_zc(_planes(new_values), level), "new"),
                 (_zc(_planes(new_values ^ old_values), level), "xor"),
                 (_zc(steps, level), "diff"), (_zc(steps, level, literal=True), "diff"),
                 key=lambda c: len(c[0]))
    gaps = np.diff(idx, prepend=0).astype(np.uint32)
    candidates = [
        ("sparse", _zc(_planes(gaps), level), *values),
        ("bitmap", _zc(np.packbits(changed, bitorder="little"), level), *values),
    ]
    if idx.size * _DENSE_FROM >= old.size:
        candidates.append(("xor", b"", _zc(_planes(old ^ new), level), "xor"))
        candidates.append(("diff", b"", _zc(_planes(_zigzag(old, new)), level), "diff"))
    kind, index, vals, coding = min(candidates, key=lambda c: len(c[1]) + len(c[2]))
    return {"kind": kind, "values": coding, "count": int(idx.size), "split": len(index),
            "data": index + vals}


def encode(old_state: Any, new_state: Any, *, from_version: int | None = None,
           to_version: int | None = None, level: int = ZSTD_LEVEL,
           old_digests: Digests | None = None, new_digests: Digests | None = None,
           threads: int | None = None) -> bytes:
    """A lossless delta turning `old_state` into `new_state` (dicts of tensors or modules).

    `old_digests` / `new_digests` may be cached `tensor_digests` of the two states.
    `threads`: None = all cores, 1 = this thread only (the output is the same).
    """
    old, new = _tensors(old_state), _tensors(new_state)
    old_d = tensor_digests(old, threads) if old_digests is None else old_digests
    new_d = tensor_digests(new, threads) if new_digests is None else new_digests
    entries, jobs = [], []
    for name in sorted(new):
        t, o = new[name], old.get(name)
        dtype, size = _dtype_name(t), t.element_size()
        entry = {"name": name, "dtype": dtype, "shape": list(t.shape)}
        entries.append(entry)
        if o is not None and _dtype_name(o) == dtype and list(o.shape) == list(t.shape):
            if old_d[name] == new_d[name]:
                entry["kind"] = "same"
                continue
            entry["kind"] = "delta"
            blocks = [b for b, (x, y) in enumerate(zip(old_d[name], new_d[name])) if x != y]
        else:
            entry["kind"] = "full"
            blocks = list(range(len(new_d[name])))
        entry["sha256"] = _tensor_digest(new_d[name]).hex()
        entry["sections"] = []
        block = _block_elems(size)
        for b in blocks:
            jobs.append((entry, b, o if entry["kind"] == "delta" else None, t,
                         b * block, min((b + 1) * block, t.numel())))

    def run(job):
        _, _, o, t, start, stop = job
        if o is None:
            data = _zc(_planes(_words(t, start, stop)), level)
            return {"kind": "raw", "values": "new", "count": stop - start, "split": 0,
                    "data": data}
        return _encode_block(_words(o, start, stop), _words(t, start, stop), level)

    sizes = [(j[5] - j[4]) * j[3].element_size() for j in jobs]
    payload, offset = [], 0
    for (entry, b, *_), sec in zip(jobs, _parallel(run, jobs, sizes, threads)):
        data = sec.pop("data")
        sec.update(block=b, offset=offset, length=len(data), crc32=zlib.crc32(data))
        entry["sections"].append(sec)
        payload.append(data)
        offset += len(data)
    header = {
        "format": FORMAT, "from_version": from_version, "to_version": to_version,
        "base_sha256": state_sha256(old, old_d), "target_sha256": state_sha256(new, new_d),
        "block_bytes": BLOCK_BYTES, "payload_bytes": offset, "tensors": entries,
    }
    head = _zc(json.dumps(header, separators=(",", ":")).encode(), level)
    return b"".join([MAGIC, struct.pack("<I", len(head)), head,
                     hashlib.sha256(head).digest(), *payload])


# ---------------------------------------------------------------------------- decode

def read_header(blob: bytes) -> dict:
    """The validated header of a delta (from/to versions, both sha256s, tensors, sections)."""
    view = memoryview(blob)
    if len(view) < len(MAGIC) + 4 or bytes(view[:len(MAGIC)]) != MAGIC:
        raise DeltaError("not an apprentice delta (bad magic or too short)")
    (n,) = struct.unpack_from("<I", view, len(MAGIC))
    start = len(MAGIC) + 4
    if len(view) < start + n + 32:
        raise DeltaError("delta truncated inside its header")
    head = view[start:start + n]
    if hashlib.sha256(head).digest() != bytes(view[start + n:start + n + 32]):
        raise DeltaError("delta header checksum mismatch (corrupted)")
    try:
        header = json.loads(zstandard.ZstdDecompressor().decompress(head))
    except (zstandard.ZstdError, ValueError) as e:
        raise DeltaError(f"delta header unreadable ({e})") from None
    if header.get("format") not in (1, FORMAT) or header.get("block_bytes") != BLOCK_BYTES:
        raise DeltaError(f"unsupported delta format {header.get('format')!r}")
    header["payload_offset"] = start + n + 32
    got = len(view) - header["payload_offset"]
    if got != header["payload_bytes"]:
        what = "truncated" if got < header["payload_bytes"] else "has trailing bytes"
        raise DeltaError(f"delta {what}: payload is {got} bytes, header says "
                         f"{header['payload_bytes']}")
    return header


def _short(sha: str | None) -> str:
    return (sha or "?")[:12]


@dataclass
class _Change:
    name: str
    start: int                 # first element of the block
    stop: int
    idx: np.ndarray | None     # changed positions within the block (None: dense)
    values: np.ndarray         # new words at idx, or the whole block


def _decode_section(blob: memoryview, base: int, entry: dict, sec: dict,
                    old: torch.Tensor | None) -> tuple[_Change, bytes]:
    name, size = entry["name"], _DTYPES[entry["dtype"]].itemsize
    numel = int(np.prod(entry["shape"], dtype=np.int64))
    block = _block_elems(size)
    start = sec["block"] * block
    stop = min(start + block, numel)
    n = stop - start
    what = f"tensor {name!r} block {sec['block']}"
    if not 0 <= sec["offset"] <= sec["offset"] + sec["length"] <= len(blob) - base or n <= 0:
        raise DeltaError(f"{what}: section out of range")
    data = blob[base + sec["offset"]:base + sec["offset"] + sec["length"]]
    if zlib.crc32(data) != sec["crc32"]:
        raise DeltaError(f"{what}: section checksum mismatch (corrupted or reordered)")
    kind, count, split = sec["kind"], sec["count"], sec["split"]
    if kind in ("raw", "xor", "diff"):
        words = _unplanes(_zd(data, n * size, what), size)
        if kind == "xor":
            words ^= _words(old, start, stop)
        elif kind == "diff":
            words = _unzigzag(_words(old, start, stop), words)
        change = _Change(name, start, stop, None, words)
    elif kind in ("sparse", "bitmap"):
        if not 0 < count <= n or not 0 <= split <= len(data):
            raise DeltaError(f"{what}: bad section counts")
        if kind == "sparse":
            gaps = _unplanes(_zd(data[:split], count * 4, what), 4).astype(np.int64)
            if (gaps[1:] == 0).any():
                raise DeltaError(f"{what}: positions not increasing")
            idx = np.cumsum(gaps)
        else:
            bits = np.frombuffer(_zd(data[:split], (n + 7) // 8, what), np.uint8)
            idx = np.flatnonzero(np.unpackbits(bits, count=n, bitorder="little"))
        if idx.size != count or (count and idx[-1] >= n):
            raise DeltaError(f"{what}: positions out of range")
        values = _unplanes(_zd(data[split:], count * size, what), size)
        if sec["values"] == "xor":
            values ^= _words(old, start, stop)[idx]
        elif sec["values"] == "diff":
            values = _unzigzag(_words(old, start, stop)[idx], values)
        elif sec["values"] != "new":
            raise DeltaError(f"{what}: unknown value coding {sec['values']!r}")
        change = _Change(name, start, stop, idx.astype(np.int32), values)
    else:
        raise DeltaError(f"{what}: unknown section kind {kind!r}")
    if change.idx is None:
        return change, hashlib.sha256(change.values).digest()
    block_words = _words(old, start, stop).copy()
    block_words[change.idx] = change.values
    return change, hashlib.sha256(block_words).digest()


@dataclass
class Patch:
    """A verified delta, ready to be committed into the state it was prepared against."""
    from_version: int | None
    to_version: int | None
    base_sha256: str | None
    sha256: str                                        # of the state after commit
    digests: Digests                                   # block digests after commit
    meta: dict[str, tuple[str, list[int]]]             # name -> (dtype, shape) after commit
    changes: list[_Change] = field(default_factory=list)
    fresh: set[str] = field(default_factory=set)         # tensors rewritten whole

    @classmethod
    def replacement(cls, new_state: Any, *, sha256: str | None = None,
                    to_version: int | None = None) -> "Patch":
        """A patch that overwrites every tensor with `new_state` (e.g. from a snapshot)."""
        tensors = _tensors(new_state)
        digests = tensor_digests(tensors)
        actual = state_sha256(tensors, digests)
        if sha256 is not None and actual != sha256:
            raise DeltaError(f"snapshot hash {_short(actual)} != expected {_short(sha256)}")
        changes = [_Change(n, 0, t.numel(), None, _words(t)) for n, t in tensors.items()]
        return cls(None, to_version, None, actual, digests, _meta(tensors), changes,
                   set(tensors))

    def commit(self, target: Any) -> None:
        """Copy the new values into `target` (a model or a dict of tensors), in place.

        `target` must be the state this patch was prepared against. Checks its names, dtypes
        and shapes before writing anything; a dict may gain or lose tensors, a model may not.
        """
        tensors = _tensors(target)
        is_dict = not isinstance(target, torch.nn.Module)
        extra = [n for n in tensors if n not in self.meta]
        create = []
        for name, (dtype, shape) in self.meta.items():
            t = tensors.get(name)
            if t is not None and (_dtype_name(t), list(t.shape)) == (dtype, shape):
                if not t.is_contiguous():
                    raise DeltaError(f"tensor {name!r} is not contiguous; cannot patch in place")
            elif name in self.fresh and is_dict:
                create.append(name)
            else:
                raise DeltaError(f"target tensor {name!r} is missing or not {dtype} {shape}")
        if extra and not is_dict:
            raise DeltaError(f"model has tensors the new state lacks: {extra[:3]}")
        for name in extra:
            del target[name]
        for name in create:
            dtype, shape = self.meta[name]
            target[name] = torch.empty(shape, dtype=_DTYPES[dtype])
        tensors = _tensors(target)
        for c in self.changes:
            _write(tensors[c.name], c)

    def materialize(self, base: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A new dict: `base` with this patch applied; unchanged tensors are shared, not copied."""
        changed = {c.name for c in self.changes} - self.fresh
        out = {n: (base[n].clone() if n in changed else base[n])
               for n in self.meta if n in base and n not in self.fresh}
        self.commit(out)
        return out


def _write(t: torch.Tensor, c: _Change) -> None:
    size = t.element_size()
    if t.device.type == "cpu":
        words = t.detach().view(-1).view(_TORCH_INT[size]).numpy().view(_UINT[size])
        if c.idx is None:
            words[c.start:c.stop] = c.values
        else:
            words[c.start:c.stop][c.idx] = c.values
        return
    flat = t.detach().view(-1).view(_TORCH_INT[size])
    values = torch.from_numpy(c.values.view(np.int8 if size == 1 else f"i{size}"))
    values = values.view(_TORCH_INT[size]).to(t.device)
    if c.idx is None:
        flat[c.start:c.stop].copy_(values)
    else:
        idx = torch.from_numpy(c.idx.astype(np.int64)).to(t.device) + c.start
        flat.index_copy_(0, idx, values)


def prepare(state: Any, blob: bytes, *, digests: Digests | None = None,
            threads: int | None = None) -> Patch:
    """Decode and fully verify `blob` against `state` without modifying anything.

    `digests` may be the cached block digests of `state` (as returned in `Patch.digests` by
    the previous patch) so that only the changed blocks are hashed. `threads`: None = all
    cores, 1 = this thread only.
    """
    header = read_header(blob)
    tensors = _tensors(state)
    if digests is None or set(digests) != set(tensors):
        digests = tensor_digests(tensors, threads)
    base_sha = state_sha256(tensors, digests)
    if base_sha != header["base_sha256"]:
        raise DeltaError(
            f"wrong base: delta v{header['from_version']}->v{header['to_version']} expects state "
            f"{_short(header['base_sha256'])}, this state is {_short(base_sha)}")
    meta, jobs, new_digests = {}, [], {}
    for entry in header["tensors"]:
        name, kind = entry["name"], entry.get("kind")
        if entry.get("dtype") not in _DTYPES:
            raise DeltaError(f"tensor {name!r}: unknown dtype {entry.get('dtype')!r}")
        meta[name] = (entry["dtype"], list(entry["shape"]))
        old = tensors.get(name)
        size = _DTYPES[entry["dtype"]].itemsize
        n_blocks = _n_blocks(int(np.prod(entry["shape"], dtype=np.int64)), size)
        if kind in ("same", "delta"):
            if old is None or (_dtype_name(old), list(old.shape)) != meta[name]:
                raise DeltaError(f"tensor {name!r}: base has a different dtype/shape or lacks it")
            new_digests[name] = list(digests[name])
        elif kind == "full":
            new_digests[name] = [b""] * n_blocks
        else:
            raise DeltaError(f"tensor {name!r}: unknown kind {kind!r}")
        seen = set()
        for sec in entry.get("sections", []):
            if not 0 <= sec["block"] < n_blocks or sec["block"] in seen:
                raise DeltaError(f"tensor {name!r}: bad or repeated block {sec['block']}")
            if (kind == "full") != (sec["kind"] == "raw"):
                raise DeltaError(f"tensor {name!r}: section kind {sec['kind']} in a {kind} tensor")
            seen.add(sec["block"])
            jobs.append((entry, sec, old if kind == "delta" else None))
        if kind == "full" and len(seen) != n_blocks:
            raise DeltaError(f"tensor {name!r}: {n_blocks - len(seen)} blocks missing")
    view, base = memoryview(blob), header["payload_offset"]
    results = _parallel(lambda j: _decode_section(view, base, *j), jobs,
                        [j[1]["length"] * 8 for j in jobs], threads)
    changes = []
    for (entry, sec, _), (change, digest) in zip(jobs, results):
        new_digests[entry["name"]][sec["block"]] = digest
        changes.append(change)
    for entry in header["tensors"]:
        name = entry["name"]
        if entry["kind"] != "same" and _tensor_digest(new_digests[name]).hex() != entry["sha256"]:
            raise DeltaError(f"tensor {name!r}: checksum mismatch after decoding")
    target = _state_hash(meta, {n: _tensor_digest(d) for n, d in new_digests.items()})
    if target != header["target_sha256"]:
        raise DeltaError(f"resulting state {_short(target)} != expected "
                         f"{_short(header['target_sha256'])}")
    fresh = {e["name"] for e in header["tensors"] if e["kind"] == "full"}
    return Patch(header["from_version"], header["to_version"], base_sha, target,
                 new_digests, meta, changes, fresh)


def apply(old_state: Any, blob: bytes, *, threads: int | None = None) -> dict[str, torch.Tensor]:
    """A new state dict: `old_state` + delta, fully verified; `old_state` is never modified.

    Unchanged tensors are shared with `old_state`, not copied.
    """
    return prepare(old_state, blob, threads=threads).materialize(_tensors(old_state))


def apply_(target: Any, blob: bytes, *, digests: Digests | None = None,
           threads: int | None = None) -> Patch:
    """Verify `blob` completely against `target` (model or dict), then patch it in place."""
    patch = prepare(target, blob, digests=digests, threads=threads)
    patch.commit(target)
    return patch
