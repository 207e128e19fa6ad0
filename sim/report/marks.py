"""How a chart's series are inked on a Pillow canvas: dashed polylines and the circle and star markers (the shapes of
matplotlib's "--", "o" and "*"), in pixel coordinates."""
from __future__ import annotations

import math

import numpy as np
from PIL import Image, ImageDraw

from sim.report.strokes import paint

DASH = (3.7, 1.6)  # matplotlib's "--": on and off lengths in units of the line width
STAR_INNER = 0.381966  # a regular five-point star's inner radius over its outer one (matplotlib's "*")


def dashes(pts: np.ndarray, on: float, off: float) -> list[np.ndarray]:
    """The pieces of the polyline `pts` (n x 2) that a dash pattern of `on` ink then `off` gap leaves inked."""
    if len(pts) < 2:
        return []
    dist = np.concatenate(([0.0], np.cumsum(np.hypot(*np.diff(pts, axis=0).T))))

    def at(t: float) -> np.ndarray:
        return np.array([[np.interp(t, dist, pts[:, 0]), np.interp(t, dist, pts[:, 1])]])

    pieces = []
    for start in np.arange(0.0, dist[-1], on + off):
        end = min(start + on, dist[-1])
        pieces.append(np.vstack((at(start), pts[(dist > start) & (dist < end)], at(end))))
    return pieces


def vertices(pts: np.ndarray) -> np.ndarray:
    """The corners of the polyline `pts` (n x 2) that Pillow's line draws: at the whole pixels it truncates them to,
    less repeats and the points inside a run along one row or column (each changes no pixel; thousands of a CDF's or
    a step plot's points fall on a few hundred pixels)."""
    p = np.trunc(pts)  # Pillow casts each coordinate to int
    if len(p) < 3:
        return p
    p = p[np.concatenate(([True], (p[1:] != p[:-1]).any(axis=1)))]
    if len(p) < 3:
        return p if len(p) > 1 else np.repeat(p, 2, axis=0)  # one point drawn as a line of length zero, as before
    a, b, c = p[:-2], p[1:-1], p[2:]
    # b lies between a and c along a row (or a column): same y (x) for the three, x (y) monotonic through b
    inside = ((a == b) & (b == c))[:, ::-1] & ((b - a) * (c - b) >= 0)
    return p[np.concatenate(([True], ~inside.any(axis=1), [True]))]


def polyline(image: Image.Image, pts: np.ndarray, color: tuple, width: int, dashed: bool) -> None:
    """A line through `pts` on `image`, solid or dashed (the dash pattern scaled by its width, as matplotlib's)."""
    pieces = dashes(pts, DASH[0] * width, DASH[1] * width) if dashed else [vertices(pts)]
    if not dashed and paint(image, pieces[0], color, width):  # a long step plot's: along rows and columns only
        return
    d = ImageDraw.Draw(image)
    for piece in pieces:
        if len(piece) > 1:
            d.line(piece.ravel().tolist(), fill=color, width=width, joint="curve")


def marker(d: ImageDraw.ImageDraw, cx: float, cy: float, shape: str, size: float, color: tuple) -> None:
    """A filled circle ("o") or five-point star ("*") of `size` pixels across, centred on (cx, cy)."""
    r = size / 2
    if shape == "*":
        corners = [(cx + (r if k % 2 == 0 else r * STAR_INNER) * math.sin(k * math.pi / 5),
                    cy - (r if k % 2 == 0 else r * STAR_INNER) * math.cos(k * math.pi / 5)) for k in range(10)]
        d.polygon(corners, fill=color)
    else:
        d.ellipse([cx - r, cy - r, cx + r, cy + r], fill=color)
