"""The version server: runtimes follow published policy versions over HTTP.

Endpoints (every one needs `Authorization: Bearer TOKEN`; nothing is served without it):

    GET /latest                  {"version": V, "sha256": H}; 404 while the store is empty.
                                 ?after=V&wait=S long-polls up to S seconds for a newer one.
    GET /versions/V              metadata of version V
    GET /find?sha256=H           {"version": V} for the version with that state hash
    GET /delta?from=A&to=B       the agent_runtime.delta blob from A to B (one file, any gap)
    GET /snapshot/V              the full state of V as safetensors
    GET /events                  server-sent events: `event: version` with {"version",
                                 "sha256"} on connect and on every new version; `: ping`
                                 comments as heartbeats

It serves a `learner.versions.VersionStore` folder and notices versions that another process
publishes there. Binds 127.0.0.1 by default. Not here: publishing, training, the CLI.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import shutil
import sys
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

from agent_runtime.delta import DeltaError
from learner.versions import VersionInfo, VersionNotFound, VersionStore

log = logging.getLogger(__name__)


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"        # interface to bind; keep local unless behind a proxy
    port: int = 8750               # 0 picks a free port
    token: str = ""                # bearer token every request must carry (required)
    poll_s: float = 0.1            # how often the store folder is checked for new versions
    heartbeat_s: float = 5.0       # keep-alive comment interval on /events


class VersionServer:
    """A threaded HTTP server over one version store; `start()` runs it in the background."""

    def __init__(self, store: VersionStore | str | Path, config: ServerConfig):
        if not config.token:
            raise ValueError("the version server needs a token")
        self.store = store if isinstance(store, VersionStore) else VersionStore(store)
        self.config = config
        self.latest: VersionInfo | None = self.store.latest()
        self.changed = threading.Condition()
        self.stopping = threading.Event()
        self.httpd = ThreadingHTTPServer((config.host, config.port), _Handler)
        self.httpd.daemon_threads = True
        self.httpd.app = self                       # type: ignore[attr-defined]
        self._threads: list[threading.Thread] = []

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "VersionServer":
        serve = lambda: self.httpd.serve_forever(poll_interval=0.05)   # noqa: E731
        for target in (serve, self._watch):
            thread = threading.Thread(target=target, daemon=True, name="version-server")
            thread.start()
            self._threads.append(thread)
        return self

    def serve_forever(self) -> None:
        threading.Thread(target=self._watch, daemon=True, name="version-watch").start()
        try:
            self.httpd.serve_forever(poll_interval=0.05)
        finally:
            self.stop()

    def stop(self) -> None:
        self.stopping.set()
        with self.changed:
            self.changed.notify_all()
        if self._threads:                 # serve_forever runs in our thread: shut it down
            self.httpd.shutdown()
        self.httpd.server_close()

    def _watch(self) -> None:
        while not self.stopping.wait(self.config.poll_s):
            try:
                latest = self.store.latest()
            except (OSError, ValueError) as e:      # a half-visible store: try again
                log.warning("cannot read the version store: %s", e)
                continue
            if latest != self.latest:
                with self.changed:
                    self.latest = latest
                    self.changed.notify_all()


class _Handler(BaseHTTPRequestHandler):
    server_version = "apprentice-versions/1"

    @property
    def app(self) -> VersionServer:
        return self.server.app                      # type: ignore[attr-defined]

    def log_message(self, format: str, *args) -> None:
        log.debug("%s %s", self.address_string(), format % args)

    def do_GET(self) -> None:
        expected = f"Bearer {self.app.config.token}".encode()
        if not hmac.compare_digest(self.headers.get("Authorization", "").encode(), expected):
            return self._json(401, {"error": "missing or wrong bearer token"})
        url = urlparse(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        parts = url.path.strip("/").split("/")
        store = self.app.store
        try:
            if parts == ["latest"]:
                return self._latest(query)
            if parts == ["events"]:
                return self._events()
            if len(parts) == 2 and parts[0] == "versions":
                return self._json(200, store.info(int(parts[1])).to_json())
            if parts == ["find"]:
                version = store.find(query.get("sha256", ""))
                if version is None:
                    return self._json(404, {"error": "no version with that sha256"})
                return self._json(200, {"version": version})
            if parts == ["delta"]:
                a, b = int(query["from"]), int(query["to"])
                blob = store.delta(a, b)
                return self._bytes(blob, "application/octet-stream", {
                    "X-From-Version": a, "X-To-Version": b, "X-Sha256": store.info(b).sha256})
            if len(parts) == 2 and parts[0] == "snapshot":
                return self._snapshot(int(parts[1]))
            return self._json(404, {"error": f"no such endpoint {url.path}"})
        except (KeyError, ValueError) as e:
            if isinstance(e, DeltaError):
                log.error("store cannot serve %s: %s", self.path, e)
                return self._json(500, {"error": f"store damaged: {e}"})
            return self._json(400, {"error": f"bad request: {e}"})
        except VersionNotFound as e:
            return self._json(404, {"error": str(e)})
        except (BrokenPipeError, ConnectionResetError):
            pass

    # ------------------------------------------------------------------ endpoints

    def _latest(self, query: dict) -> None:
        app = self.app
        if "after" in query:
            after, wait = int(query["after"]), min(float(query.get("wait", 30)), 60.0)
            with app.changed:
                app.changed.wait_for(lambda: app.stopping.is_set() or (
                    app.latest is not None and app.latest.version > after), timeout=wait)
        latest = app.store.latest()
        if latest is None:
            return self._json(404, {"error": "no version published yet"})
        self._json(200, {"version": latest.version, "sha256": latest.sha256})

    def _events(self) -> None:
        app = self.app
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        sent = None
        while not app.stopping.is_set():
            latest = app.latest
            if latest is not None and latest != sent:
                data = json.dumps({"version": latest.version, "sha256": latest.sha256})
                self.wfile.write(f"id: {latest.version}\nevent: version\ndata: {data}\n\n".encode())
                sent = latest
            else:
                self.wfile.write(b": ping\n\n")
            self.wfile.flush()
            with app.changed:
                app.changed.wait_for(lambda: app.stopping.is_set() or app.latest != sent,
                                     timeout=app.config.heartbeat_s)

    def _snapshot(self, version: int) -> None:
        with self.app.store.open_snapshot(version) as f:
            size = os.fstat(f.fileno()).st_size
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(size))
            self.send_header("X-Version", str(version))
            self.send_header("X-Sha256", self.app.store.info(version).sha256)
            self.end_headers()
            shutil.copyfileobj(f, self.wfile, 1 << 20)

    # ------------------------------------------------------------------ helpers

    def _json(self, status: int, body: dict) -> None:
        extra = {"WWW-Authenticate": "Bearer"} if status == 401 else {}
        self._bytes(json.dumps(body).encode(), "application/json", extra, status)

    def _bytes(self, data: bytes, content_type: str, headers: dict, status: int = 200) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        for key, value in headers.items():
            self.send_header(key, str(value))
        self.end_headers()
        view = memoryview(data)
        for start in range(0, len(view), 1 << 20):
            self.wfile.write(view[start:start + (1 << 20)])


def serve(store_dir: str | Path, host: str = "127.0.0.1", port: int = 8750,
          token: str = "") -> None:
    """Serve the version store in `store_dir` until interrupted (what `apprentice serve` runs)."""
    server = VersionServer(store_dir, ServerConfig(host=host, port=port, token=token))
    print(f"serving policy versions from {store_dir} at {server.url}", file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
