"""Newline-delimited JSON-RPC on stdio for the ACP server, strict about what it accepts.

The SDK's own stdio framing logs and drops a line that is not JSON, reads a line of any size
into memory, and stops serving on a JSON value that is not an object. This transport (the
SDK's `Transport` seam: it moves decoded messages, the SDK does the JSON-RPC) answers each
such line with a JSON-RPC error instead and goes on reading:
- not JSON: -32700 parse error (id null);
- JSON that is not a request, notification or response object: -32600 invalid request;
- a line longer than `max_message_bytes`: -32600, the line discarded without being kept.
It does not validate methods or parameters; the SDK answers those (-32601, -32602).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

log = logging.getLogger(__name__)
MAX_MESSAGE_BYTES = 16 * 2**20                 # default limit of one incoming message


class GuardedTransport:
    """An `acp` Transport over asyncio byte streams (stdin/stdout)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 max_message_bytes: int = MAX_MESSAGE_BYTES):
        self.reader, self.writer = reader, writer
        self.max_message_bytes = max_message_bytes
        self._closed = False

    async def send(self, message: dict[str, Any]) -> None:
        if self._closed:
            raise ConnectionError("transport closed")
        # written before the first await, so messages leave in the order they are sent
        self.writer.write((json.dumps(message, separators=(",", ":"), ensure_ascii=False)
                           + "\n").encode("utf-8"))
        await self.writer.drain()

    async def receive(self) -> dict[str, Any] | None:
        while True:
            line = await self._read_line()
            if line is None:
                return None
            if not line.strip():
                continue
            try:
                message = json.loads(line)
            except ValueError as exc:
                await self._error(None, -32700, "Parse error", f"not JSON: {exc}")
                continue
            problem = _shape_problem(message)
            if problem is None:
                return message
            request_id = message.get("id") if isinstance(message, dict) else None
            await self._error(request_id if isinstance(request_id, (int, str)) else None,
                              -32600, "Invalid request", problem)

    async def _read_line(self) -> bytes | None:
        """The next line, or None at end of input; an oversized line is answered and skipped."""
        size, too_big = 0, False
        chunks: list[bytes] = []
        while True:
            try:
                chunk = await self.reader.readuntil(b"\n")
                done = True
            except asyncio.LimitOverrunError as exc:
                chunk, done = await self.reader.readexactly(exc.consumed), False
            except asyncio.IncompleteReadError as exc:
                chunk, done = exc.partial, True
                if not chunk and not chunks and not too_big:
                    return None
            size += len(chunk)
            if size > self.max_message_bytes:
                too_big, chunks = True, []
            elif not too_big:
                chunks.append(chunk)
            if done:
                break
        if too_big:
            await self._error(None, -32600, "Invalid request",
                              f"message of {size:,} bytes exceeds the limit of "
                              f"{self.max_message_bytes:,}; discarded")
            return b""
        return b"".join(chunks)

    async def _error(self, request_id: Any, code: int, message: str, details: str) -> None:
        log.warning("rejected an incoming message: %s", details)
        await self.send({"jsonrpc": "2.0", "id": request_id,
                         "error": {"code": code, "message": message, "data": {"details": details}}})

    async def close(self) -> None:
        self._closed = True
        try:
            self.writer.close()
        except Exception:                       # stdout already gone: nothing left to flush
            pass


def _shape_problem(message: Any) -> str | None:
    """Why `message` is not a JSON-RPC 2.0 message object, or None when it is one."""
    if not isinstance(message, dict):
        return f"a message must be a JSON object, got {type(message).__name__}"
    if "method" in message:
        if not isinstance(message["method"], str):
            return "`method` must be a string"
        if "params" in message and not isinstance(message["params"], (dict, list, type(None))):
            return "`params` must be an object or an array"
        return None
    if "id" in message and ("result" in message or "error" in message):
        return None
    return "neither a request, a notification nor a response"


async def stdio_transport(max_message_bytes: int = MAX_MESSAGE_BYTES) -> GuardedTransport:
    """The transport over this process's stdin and stdout (the SDK opens the streams)."""
    from acp import stdio_streams
    reader, writer = await stdio_streams(limit=2**20)
    return GuardedTransport(reader, writer, max_message_bytes)
