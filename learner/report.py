"""`apprentice learn report`: a PNG of a GRPO run's curves (reward, pass rate, train-vs-
behaviour KL, route-flip rate per step) from the run folder's `metrics.db`.

Uses matplotlib when it is installed; otherwise a small built-in rasterizer (lines, frames and
a 3x5 pixel font, written with zlib) so the report works with the base dependencies. It does
not compute metrics; the trainer records them.
"""

from __future__ import annotations

import math
import sqlite3
import struct
import zlib
from pathlib import Path
from typing import Sequence

PANELS = [("reward_mean", "reward"), ("pass_rate", "pass rate"),
          ("kl", "kl train vs behaviour"), ("flip_rate", "route flip rate")]


def load_metrics(run_dir: str | Path) -> list[dict]:
    """The `steps` rows of a run folder, in step order ([] if none yet)."""
    path = Path(run_dir) / "metrics.db"
    if not path.exists():
        return []
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    conn.row_factory = sqlite3.Row
    try:
        if not conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'steps'").fetchone():
            return []
        return [dict(r) for r in conn.execute("SELECT * FROM steps ORDER BY step")]
    finally:
        conn.close()


def series(rows: Sequence[dict]) -> list[tuple[str, list[tuple[float, float]]]]:
    """(title, [(step, value)]) per panel, skipping missing values."""
    out = []
    for key, title in PANELS:
        pts = [(float(r["step"]), float(r[key])) for r in rows
               if r.get(key) is not None and math.isfinite(float(r[key]))]
        out.append((title, pts))
    return out


def write_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the run's curves as a PNG (default `run_dir/report.png`); returns its path."""
    rows = load_metrics(run_dir)
    if not rows:
        raise ValueError(f"{run_dir}: no metrics recorded yet (metrics.db has no steps)")
    out = Path(out) if out is not None else Path(run_dir) / "report.png"
    panels = series(rows)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        out.write_bytes(render_png(panels))
        return out
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (title, pts) in zip(axes.flat, panels):
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts])
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


# -- the fallback rasterizer ---------------------------------------------------------------------

FONT = {  # 3x5 glyphs, rows top to bottom
    "A": "010101111101101", "B": "110101110101110", "C": "011100100100011",
    "D": "110101101101110", "E": "111100110100111", "F": "111100110100100",
    "G": "011100101101011", "H": "101101111101101", "I": "111010010010111",
    "J": "001001001101010", "K": "101101110101101", "L": "100100100100111",
    "M": "101111111101101", "N": "110101101101101", "O": "010101101101010",
    "P": "110101110100100", "Q": "010101101110011", "R": "110101110101101",
    "S": "011100010001110", "T": "111010010010010", "U": "101101101101111",
    "V": "101101101101010", "W": "101101111111101", "X": "101101010101101",
    "Y": "101101010010010", "Z": "111001010100111", "0": "111101101101111",
    "1": "010110010010111", "2": "110001010100111", "3": "110001010001110",
    "4": "101101111001001", "5": "111100110001110", "6": "011100111101111",
    "7": "111001010010010", "8": "111101111101111", "9": "111101111001110",
    ".": "000000000000010", "-": "000000111000000", "+": "000010111010000",
    ":": "000010000010000", "/": "001001010100100", "%": "101001010100101",
    " ": "000000000000000",
}
W, H = 800, 560
BG, INK, LINE, GRID = (255, 255, 255), (40, 40, 40), (31, 119, 180), (225, 225, 225)


class Canvas:
    def __init__(self, w: int, h: int):
        self.w, self.h = w, h
        self.px = bytearray(bytes(BG) * (w * h))

    def dot(self, x: int, y: int, color: tuple[int, int, int]) -> None:
        if 0 <= x < self.w and 0 <= y < self.h:
            i = 3 * (y * self.w + x)
            self.px[i:i + 3] = bytes(color)

    def line(self, x0: int, y0: int, x1: int, y1: int, color, width: int = 1) -> None:
        n = max(abs(x1 - x0), abs(y1 - y0), 1)
        for i in range(n + 1):
            x, y = round(x0 + (x1 - x0) * i / n), round(y0 + (y1 - y0) * i / n)
            for d in range(width):
                self.dot(x, y + d, color)

    def text(self, x: int, y: int, s: str, color=INK, scale: int = 2) -> None:
        for ch in s.upper():
            glyph = FONT.get(ch, FONT[" "])
            for j, bit in enumerate(glyph):
                if bit == "1":
                    for a in range(scale):
                        for b in range(scale):
                            self.dot(x + (j % 3) * scale + a, y + (j // 3) * scale + b, color)
            x += 4 * scale

    def png(self) -> bytes:
        raw = b"".join(b"\x00" + bytes(self.px[3 * self.w * y:3 * self.w * (y + 1)])
                       for y in range(self.h))

        def chunk(kind: bytes, data: bytes) -> bytes:
            return (struct.pack(">I", len(data)) + kind + data
                    + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))
        header = struct.pack(">IIBBBBB", self.w, self.h, 8, 2, 0, 0, 0)   # 8-bit RGB
        return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
                + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def _fmt(v: float) -> str:
    return f"{v:.3g}" if abs(v) >= 1e-3 or v == 0 else f"{v:.1e}"


def render_png(panels: Sequence[tuple[str, Sequence[tuple[float, float]]]]) -> bytes:
    """A 2x2 grid of line plots as PNG bytes (title, y range and step range per panel)."""
    c = Canvas(W, H)
    pw, ph = W // 2, H // 2
    for n, (title, pts) in enumerate(panels[:4]):
        ox, oy = (n % 2) * pw, (n // 2) * ph
        x0, y0, x1, y1 = ox + 70, oy + 34, ox + pw - 20, oy + ph - 36   # plot area
        c.text(ox + 70, oy + 10, title)
        for gx in range(5):
            gy = y0 + (y1 - y0) * gx // 4
            c.line(x0, gy, x1, gy, GRID)
        for a, b in (((x0, y0), (x1, y0)), ((x0, y1), (x1, y1)), ((x0, y0), (x0, y1)),
                     ((x1, y0), (x1, y1))):
            c.line(*a, *b, INK)
        if not pts:
            c.text(x0 + 10, (y0 + y1) // 2, "no data")
            continue
        xs, ys = [p[0] for p in pts], [p[1] for p in pts]
        lo, hi = min(ys), max(ys)
        if hi - lo < 1e-12:
            lo, hi = lo - 0.5 * (abs(lo) or 1), hi + 0.5 * (abs(hi) or 1)
        sx0, sx1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
        c.text(ox + 4, y0 - 2, _fmt(hi))
        c.text(ox + 4, y1 - 8, _fmt(lo))
        c.text(x0, y1 + 8, f"step {_fmt(sx0)}")
        c.text(x1 - 60, y1 + 8, _fmt(sx1))

        def to_px(x: float, y: float) -> tuple[int, int]:
            return (round(x0 + (x - sx0) / (sx1 - sx0) * (x1 - x0)),
                    round(y1 - (y - lo) / (hi - lo) * (y1 - y0)))
        prev = to_px(*pts[0])
        for p in pts[1:]:
            cur = to_px(*p)
            c.line(*prev, *cur, LINE, width=2)
            prev = cur
        if len(pts) == 1:
            c.line(prev[0] - 2, prev[1], prev[0] + 2, prev[1], LINE, width=3)
    return c.png()
