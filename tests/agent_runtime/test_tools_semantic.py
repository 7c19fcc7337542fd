"""semantic_search: chunking, BM25 ranking, incremental updates in SQLite, the tool's output."""

from __future__ import annotations

import time

import numpy as np
import pytest

from agent_runtime.tools import ToolContext
from agent_runtime.tools.chunking import chunk_file, tokenize
from agent_runtime.tools.files import EditFile
from agent_runtime.tools.semantic import SemanticIndex, SemanticSearch, close_all, load_embedder

FILES = {
    "app/config.py": '''
import tomllib


def parse_config(path):
    """Read the TOML configuration file and return the settings."""
    with open(path, "rb") as f:
        return tomllib.load(f)
''',
    "app/mail.py": '''
import smtplib


def send_email(to, subject, body):
    """Send an email notification through the SMTP server."""
    with smtplib.SMTP("localhost") as smtp:
        smtp.sendmail("noreply@example.com", [to], f"Subject: {subject}\\n\\n{body}")
''',
    "app/hashing.py": '''
import hashlib


def compute_checksum(path):
    """sha256 digest of a file, read in blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(65536), b""):
            h.update(block)
    return h.hexdigest()
''',
    "app/users.py": '''
class UserRepository:
    """Users stored in the database."""

    def __init__(self, db):
        self.db = db

    def get_by_id(self, user_id):
        return self.db.execute("SELECT * FROM users WHERE id = ?", (user_id,)).fetchone()
''',
    "web/router.js": '''
export function routeRequest(url, handlers) {
  // match the request path against registered route handlers
  for (const [prefix, handler] of handlers) {
    if (url.startsWith(prefix)) return handler(url);
  }
  return notFound(url);
}
''',
    "README.md": "# demo app\n\nA small demo used by the semantic search tests.\n",
}


@pytest.fixture
def ws(tmp_path):
    root = tmp_path / "ws"
    for rel, text in FILES.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text.lstrip("\n"))
    return root


@pytest.fixture
def index(ws, tmp_path):
    ix = SemanticIndex(ws, tmp_path / "index.db", embedder=None)
    yield ix
    ix.close()


@pytest.mark.parametrize("query,name", [
    ("parse the configuration file", "parse_config"),
    ("send an email notification", "send_email"),
    ("sha256 checksum of a file", "compute_checksum"),
    ("look up a user by id in the database", "UserRepository"),
    ("route a request url to its handler", ""),
])
def test_bm25_ranks_the_right_chunk_first(index, query, name):
    best = index.search(query, k=3)[0]
    assert best.name == name
    if not name:
        assert best.path == "web/router.js"


def test_editing_a_file_updates_the_index(index, ws):
    assert all(h.name != "calibrate_flux" for h in index.search("calibrate flux capacitor"))
    with open(ws / "app/mail.py", "a") as f:
        f.write("\n\ndef calibrate_flux(capacitor):\n    return capacitor.level * 1.21\n")
    assert index.search("calibrate flux capacitor")[0].name == "calibrate_flux"


def test_deleted_file_leaves_the_index(index, ws):
    assert index.search("send an email")[0].name == "send_email"
    (ws / "app/mail.py").unlink()
    assert all(h.path != "app/mail.py" for h in index.search("send an email"))


def test_index_persists_and_skips_unchanged_files(ws, tmp_path):
    first = SemanticIndex(ws, tmp_path / "index.db", embedder=None)
    assert first.update() == len(FILES)
    first.close()
    again = SemanticIndex(ws, tmp_path / "index.db", embedder=None)
    assert again.update() == 0
    assert again.search("sha256 checksum")[0].name == "compute_checksum"
    again.close()


def test_watcher_picks_up_external_edits(ws, tmp_path):
    ix = SemanticIndex(ws, tmp_path / "index.db", embedder=None)
    try:
        if not ix.start_watching():
            pytest.skip("no file watcher available here")
        ix.search("anything")
        (ws / "app/late.py").write_text("def reticulate_splines(n):\n    return n\n")
        deadline = time.monotonic() + 10
        while True:
            hits = ix.search("reticulate splines")
            if hits and hits[0].name == "reticulate_splines":
                break
            assert time.monotonic() < deadline, "watcher never reported the new file"
            time.sleep(0.05)
    finally:
        ix.close()


def test_tool_edits_are_seen_at_once(ws, tmp_path):
    ctx = ToolContext(workspace=ws, extras={"index_path": str(tmp_path / "ix.db"), "embeddings": False})
    try:
        assert "send_email" in SemanticSearch()({"query": "send an email"}, ctx).text
        EditFile()({"path": "app/mail.py", "old": "def send_email(", "new": "def deliver_letter("}, ctx)
        res = SemanticSearch()({"query": "deliver letter", "k": 1}, ctx)
        assert res.data["hits"][0]["name"] == "deliver_letter"
    finally:
        close_all()


def test_tool_output_lists_path_lines_and_snippet(ws, tmp_path):
    ctx = ToolContext(workspace=ws, extras={"index_path": str(tmp_path / "ix.db"), "embeddings": False})
    try:
        res = SemanticSearch()({"query": "sha256 checksum of a file", "k": 2}, ctx)
    finally:
        close_all()
    first = res.text.splitlines()[:2]
    assert first == ["1. app/hashing.py:4-10 function compute_checksum",
                     "     4\tdef compute_checksum(path):"]
    assert len(res.data["hits"]) == 2


def test_python_is_chunked_by_definition():
    text = "import os\n\nX = 1\n\n\n@decorator\ndef f():\n    pass\n\n\nclass C:\n    y = 2\n"
    chunks = [(c.kind, c.name, c.start, c.end) for c in chunk_file("m.py", text)]
    assert chunks == [("module", "", 1, 5), ("function", "f", 6, 8), ("class", "C", 11, 12)]


def test_big_class_is_chunked_by_method():
    methods = "".join(f"    def m{i}(self):\n" + "        x = 1\n" * 20 + "\n" for i in range(5))
    chunks = chunk_file("big.py", "class Big:\n    '''doc'''\n\n" + methods)
    assert [c.name for c in chunks] == ["Big"] + [f"Big.m{i}" for i in range(5)]


def test_other_files_are_chunked_in_overlapping_windows():
    chunks = chunk_file("notes.txt", "".join(f"line {i}\n" for i in range(1, 101)))
    assert [(c.start, c.end) for c in chunks] == [(1, 40), (31, 70), (61, 100)]


def test_tokenize_splits_identifiers_and_stems():
    assert tokenize("parseConfigFile") == ["parseconfigfile", "pars", "config", "fil"]
    assert set(tokenize("parsing the config files")) == {"pars", "config", "fil"}


class ConceptEmbedder:
    """A stand-in embedding model: words of the same concept share a direction."""
    name = "concepts"
    CONCEPTS = [("car", "automobile", "vehicle"), ("email", "mail", "letter")]

    def encode(self, texts):
        out = np.zeros((len(texts), len(self.CONCEPTS) + 1), dtype=np.float32)
        for i, text in enumerate(texts):
            for j, words in enumerate(self.CONCEPTS):
                out[i, j] = sum(text.lower().count(w) for w in words)
            out[i, -1] = 0.1
        return out / np.linalg.norm(out, axis=1, keepdims=True)


def test_dense_scores_are_fused_with_bm25(ws, tmp_path):
    (ws / "garage.py").write_text("def park(car):\n    return car.stop()\n")
    ix = SemanticIndex(ws, tmp_path / "index.db", embedder=ConceptEmbedder())
    try:
        assert ix.search("automobile", k=1)[0].name == "park"      # no shared term: dense only
        assert ix.search("sha256 checksum", k=1)[0].name == "compute_checksum"
    finally:
        ix.close()


def test_real_embedding_model_when_installed(ws, tmp_path):
    embedder = load_embedder()
    if embedder is None:
        pytest.skip("the optional embedding model (apprentice[embeddings]) is not installed")
    ix = SemanticIndex(ws, tmp_path / "index.db", embedder=embedder)
    try:
        assert ix.search("deliver a message to someone's inbox", k=1)[0].name == "send_email"
    finally:
        ix.close()
