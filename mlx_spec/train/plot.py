"""A dependency-free line chart written as a PNG (zlib + struct), for loss and tau curves.

Axes carry their min/max values in a tiny built-in 3x5 digit font; series are colored lines
(colors in order: blue, orange, green, red). Good enough to eyeball a training run.
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np

COLORS = ((31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40))
# 3x5 glyphs, rows top to bottom, 3 bits each.
GLYPHS = {
    "0": (7, 5, 5, 5, 7),
    "1": (2, 6, 2, 2, 7),
    "2": (7, 1, 7, 4, 7),
    "3": (7, 1, 7, 1, 7),
    "4": (5, 5, 7, 1, 1),
    "5": (7, 4, 7, 1, 7),
    "6": (7, 4, 7, 5, 7),
    "7": (7, 1, 1, 1, 1),
    "8": (7, 5, 7, 5, 7),
    "9": (7, 5, 7, 1, 7),
    ".": (0, 0, 0, 0, 2),
    "-": (0, 0, 7, 0, 0),
}


def _text(img: np.ndarray, x: int, y: int, s: str, scale: int = 2) -> None:
    for ch in s:
        rows = GLYPHS.get(ch)
        if rows:
            for r, bits in enumerate(rows):
                for c in range(3):
                    if bits >> (2 - c) & 1:
                        img[y + r * scale : y + (r + 1) * scale, x + c * scale : x + (c + 1) * scale] = 0
        x += 4 * scale


def _line(img: np.ndarray, x0: int, y0: int, x1: int, y1: int, color) -> None:
    n = max(abs(x1 - x0), abs(y1 - y0), 1)
    xs = np.rint(np.linspace(x0, x1, n + 1)).astype(int)
    ys = np.rint(np.linspace(y0, y1, n + 1)).astype(int)
    for dy in (0, 1):
        img[np.clip(ys + dy, 0, img.shape[0] - 1), xs] = color


def _fmt(v: float) -> str:
    return f"{v:.3g}" if abs(v) < 1e4 else f"{v:.0f}"


def line_chart_png(
    path: str | Path,
    series: list[tuple[str, list[tuple[float, float]]]],
    width: int = 640,
    height: int = 360,
    title: str = "",
) -> None:
    """Write ``series`` [(name, [(x, y), ...]), ...] as a line chart PNG."""
    img = np.full((height, width, 3), 255, np.uint8)
    left, right, top, bottom = 60, 20, 20, 40
    pts = [p for _, s in series for p in s]
    if pts:
        xs, ys = np.array([p[0] for p in pts], float), np.array([p[1] for p in pts], float)
        x0, x1 = xs.min(), max(xs.max(), xs.min() + 1e-9)
        y0, y1 = ys.min(), ys.max()
        pad = (y1 - y0) * 0.05 or 0.5
        y0, y1 = y0 - pad, y1 + pad
        W, H = width - left - right, height - top - bottom

        def px(x, y):
            return (int(left + (x - x0) / (x1 - x0) * W), int(top + (1 - (y - y0) / (y1 - y0)) * H))

        for i, (_, s) in enumerate(series):
            color = COLORS[i % len(COLORS)]
            for (a, b), (c, d) in zip(s, s[1:]):
                _line(img, *px(a, b), *px(c, d), color)
            if len(s) == 1:
                x, y = px(*s[0])
                img[max(0, y - 2) : y + 3, max(0, x - 2) : x + 3] = color
            img[top + 4 + 14 * i : top + 12 + 14 * i, width - right - 30 : width - right - 10] = color
        _text(img, 4, top, _fmt(y1))
        _text(img, 4, height - bottom - 10, _fmt(y0))
        _text(img, left, height - bottom + 8, _fmt(x0))
        _text(img, width - right - 50, height - bottom + 8, _fmt(x1))
    img[top : height - bottom, left - 1] = 0
    img[height - bottom, left - 1 : width - right] = 0
    raw = b"".join(b"\x00" + img[r].tobytes() for r in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    png = (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
        + chunk(b"IDAT", zlib.compress(raw, 9))
        + chunk(b"IEND", b"")
    )
    Path(path).write_bytes(png)
