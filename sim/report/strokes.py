"""A polyline whose every segment runs along a row or a column (a step plot's), inked with numpy as the very pixels
Pillow's line would ink (tests/test_png.py holds the two side by side), in a fraction of its time: Pillow fills each
thin segment as a polygon, ~1.7 us a segment, and a step plot of a long run has thousands."""
from __future__ import annotations

import math

import numpy as np
from PIL import Image

MIN_SEGMENTS = 500  # below this Pillow's line is as quick
WIDTHS = (1, 2, 3, 4)  # above 4 Pillow rounds the joints (joint="curve"): not rectangles any more


def runs(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The flat indices of runs of `lengths` consecutive cells from `starts`, all in one array."""
    if not len(starts):
        return np.zeros(0, np.int64)
    offsets = np.repeat(starts - np.concatenate(([0], np.cumsum(lengths)[:-1])), lengths)
    return offsets + np.arange(int(lengths.sum()))


def band(lines: int, stride: int, line0: np.ndarray, line1: np.ndarray, span0: np.ndarray, span1: np.ndarray
         ) -> np.ndarray:
    """A `lines` x `stride` mask inked with each rectangle given as lines line0..line1, cells span0..span1 of each:
    one run of cells a line (a rectangle is a few lines thick and long along them)."""
    mask = np.zeros(lines * stride, bool)
    for k in range(int((line1 - line0).max(initial=-1)) + 1):  # the rectangles' first lines, then their second ...
        inside = line0 + k <= line1
        mask[runs(((line0 + k) * stride + span0)[inside], (span1 - span0 + 1)[inside])] = True
    return mask.reshape(lines, stride)


def rectangles(p: np.ndarray, width: int) -> tuple[np.ndarray, ...]:
    """Each segment of the whole-pixel polyline `p` as the rows r0..r1 and columns c0..c1 (inclusive) Pillow inks:
    the width's extra row (column) on the right-hand side of the segment's direction, as its polygon falls."""
    x0, y0, x1, y1 = p[:-1, 0], p[:-1, 1], p[1:, 0], p[1:, 1]
    lo, hi = math.floor((width - 1) / 2), math.ceil((width - 1) / 2)
    forward = (x1 > x0) | (y1 > y0)  # rightward or down: the wider side below (right of) the segment
    below, above = np.where(forward, hi, lo), np.where(forward, lo, hi)
    level = y0 == y1
    r0 = np.where(level, y0 - above, np.minimum(y0, y1))
    r1 = np.where(level, y0 + below, np.maximum(y0, y1))
    c0 = np.where(level, np.minimum(x0, x1), x0 - above)
    c1 = np.where(level, np.maximum(x0, x1), x0 + below)
    return level, r0, r1, c0, c1


def paint(image: Image.Image, p: np.ndarray, color: tuple, width: int) -> bool:
    """Ink the polyline `p` (whole-pixel corners, no repeats) `width` pixels wide on `image` when every segment runs
    along a row or a column and it pays; False (nothing drawn) otherwise."""
    if width not in WIDTHS or len(p) <= MIN_SEGMENTS or not ((p[1:] == p[:-1]).any(axis=1)).all():
        return False
    w, h = image.size
    level, *box = rectangles(p.astype(np.int64), width)
    r0, r1, c0, c1 = np.maximum(box[0], 0), np.minimum(box[1], h - 1), np.maximum(box[2], 0), np.minimum(box[3], w - 1)
    keep = (r0 <= r1) & (c0 <= c1)  # off the image: Pillow clips
    if not keep.any():
        return True
    level, r0, r1, c0, c1 = level[keep], r0[keep], r1[keep], c0[keep], c1[keep]
    top, left, bottom, right = int(r0.min()), int(c0.min()), int(r1.max()) + 1, int(c1.max()) + 1
    r0, r1, c0, c1 = r0 - top, r1 - top, c0 - left, c1 - left
    rows, cols = bottom - top, right - left
    upright = ~level
    mask = band(rows, cols, r0[level], r1[level], c0[level], c1[level])  # level segments, row by row
    mask |= band(cols, rows, c0[upright], c1[upright], r0[upright], r1[upright]).T  # upright ones, column by column
    image.paste(color, (left, top), Image.fromarray(mask))  # a mode "1" mask: copied where set, not blended
    return True
