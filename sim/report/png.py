"""A small line-chart canvas drawn with Pillow: axes with ticks, grid, title, labels, lines and steps, a legend, saved
as PNG. The report's three plots are lines on axes; matplotlib (a third of a second to import, as long again to lay
out and draw) stays for the commands whose charts need more. Drawn at twice the size and halved, for smooth lines."""
from __future__ import annotations

import importlib.util
import math
from functools import lru_cache
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

SCALE = 2  # supersampling: drawn at twice the size, then halved (antialiased lines)
COLORS = ((31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189), (140, 86, 75))  # tab10
GRID, FRAME, LEGEND_EDGE = (231, 231, 231), (0, 0, 0), (204, 204, 204)
PT = 90 / 72  # pixels per point at the plots' 90 dpi
PNG = {"compress_level": 1}  # zlib level 1: a fraction of the default's time for lines on white


@lru_cache(maxsize=8)
def font(size_pt: float) -> ImageFont.FreeTypeFont:
    """DejaVu Sans (matplotlib's own font, found without importing matplotlib) at `size_pt`, else Pillow's default."""
    px = round(size_pt * PT * SCALE)
    spec = importlib.util.find_spec("matplotlib")
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        ttf = Path(folder) / "mpl-data" / "fonts" / "ttf" / "DejaVuSans.ttf"
        if ttf.is_file():
            return ImageFont.truetype(str(ttf), px)
    return ImageFont.load_default(px)


def nice_ticks(lo: float, hi: float, bins: int) -> tuple[list[float], int]:
    """Ticks at the smallest round step (1, 2, 2.5 or 5 times a power of ten) that cuts [lo, hi] into at most `bins`
    intervals (matplotlib's MaxNLocator), and the decimals their labels need."""
    raw = (hi - lo) / max(bins, 1)
    mag = 10 ** math.floor(math.log10(raw))
    m = next(m for m in (1, 2, 2.5, 5, 10) if m * mag >= raw * (1 - 1e-9))
    step = m * mag
    ticks = [k * step for k in range(math.ceil(lo / step - 1e-9), math.floor(hi / step + 1e-9) + 1)]
    decimals = max(0, -math.floor(math.log10(step) + 1e-9) + (1 if m == 2.5 else 0))
    return ticks, decimals


def label(v: float, decimals: int) -> str:
    """A tick's label: fixed decimals, or three significant digits for very large or small numbers."""
    if decimals > 4 or abs(v) >= 1e7:
        return f"{v:.3g}"
    text = f"{v:.{decimals}f}"
    return text[1:] if text.startswith("-") and float(text) == 0 else text


def limits(values: list[np.ndarray], pad: float = 0.05) -> tuple[float, float]:
    """The data's range widened by `pad` of it on each side (matplotlib's margins); (0, 1) without data."""
    finite = [v[np.isfinite(v)] for v in values]
    finite = [v for v in finite if len(v)]
    if not finite:
        return 0.0, 1.0
    lo, hi = min(float(v.min()) for v in finite), max(float(v.max()) for v in finite)
    if hi - lo <= 1e-12 * max(abs(lo), abs(hi), 1e-300):
        half = max(abs(lo) * 0.05, 0.5)
        return lo - half, hi + half
    span = hi - lo
    return lo - pad * span, hi + pad * span


class Axes:
    """One chart on a Canvas: lines and steps added, then drawn with ticks, grid, labels and legend."""

    def __init__(self, canvas: Canvas, box: tuple[float, float, float, float]):
        self.canvas, self.box = canvas, box  # left, top, right, bottom in pixels
        self.lines: list[tuple[np.ndarray, np.ndarray, str | None, tuple, float]] = []
        self.title = self.xlabel = self.ylabel = ""
        self.legend = False

    def plot(self, x: np.ndarray, y: np.ndarray, label: str | None = None, lw: float = 1.5, alpha: float = 1.0) -> None:
        """A line through (x, y) in the next color, `alpha` of it over the white."""
        color = tuple(round(c * alpha + 255 * (1 - alpha)) for c in COLORS[len(self.lines) % len(COLORS)])
        self.lines.append((np.asarray(x, float), np.asarray(y, float), label, color, lw))

    def step(self, x: np.ndarray, y: np.ndarray, label: str | None = None, lw: float = 1.5, alpha: float = 1.0) -> None:
        """y[i] held from x[i] to x[i + 1] (matplotlib's step where="post")."""
        x, y = np.asarray(x, float), np.asarray(y, float)
        self.plot(np.repeat(x, 2)[1:], np.repeat(y, 2)[:-1], label, lw, alpha)

    def draw(self) -> None:
        """Grid, frame, ticks and their labels, the lines, titles and the legend."""
        d, (left, top, right, bottom) = self.canvas.draw, self.box
        xlim, ylim = limits([x for x, *_ in self.lines]), limits([y for _, y, *_ in self.lines])
        sx = (right - left) / (xlim[1] - xlim[0])
        sy = (bottom - top) / (ylim[1] - ylim[0])
        small, tick = font(10), 3.5 * PT * SCALE
        # as many intervals as labels of 10 points fit, three font sizes apart across (_xticks), two up, at most 9
        xticks, xd = self._xticks(xlim, small)
        yticks, yd = nice_ticks(*ylim, max(1, min(9, int((bottom - top) / (PT * SCALE) / 20))))
        for v in xticks:
            px = left + (v - xlim[0]) * sx
            d.line([(px, top), (px, bottom)], fill=GRID, width=SCALE)
            d.line([(px, bottom), (px, bottom + tick)], fill=FRAME, width=SCALE)
            d.text((px, bottom + tick + 2 * SCALE), label(v, xd), font=small, fill=FRAME, anchor="mt")
        for v in yticks:
            py = bottom - (v - ylim[0]) * sy
            d.line([(left, py), (right, py)], fill=GRID, width=SCALE)
            d.line([(left - tick, py), (left, py)], fill=FRAME, width=SCALE)
            d.text((left - tick - 2 * SCALE, py), label(v, yd), font=small, fill=FRAME, anchor="rm")
        for x, y, _, color, lw in self.lines:
            keep = np.isfinite(x) & np.isfinite(y)
            pts = np.column_stack((left + (x[keep] - xlim[0]) * sx, bottom - (y[keep] - ylim[0]) * sy))
            if len(pts) > 1:
                d.line(pts.ravel().tolist(), fill=color, width=max(1, round(lw * PT * SCALE)), joint="curve")
        d.rectangle([left, top, right, bottom], outline=FRAME, width=SCALE)
        d.text(((left + right) / 2, top - 6 * SCALE), self.title, font=font(12), fill=FRAME, anchor="mb")
        d.text(((left + right) / 2, bottom + tick + 18 * SCALE), self.xlabel, font=small, fill=FRAME, anchor="mt")
        width = max((d.textlength(label(v, yd), font=small) for v in yticks), default=0)
        self.canvas.vertical_text(left - tick - width - 8 * SCALE, (top + bottom) / 2, self.ylabel, small)
        if self.legend:
            self._draw_legend()

    def _xticks(self, xlim: tuple[float, float], f: ImageFont.FreeTypeFont) -> tuple[list[float], int]:
        """The x ticks: fewer than matplotlib's count where their labels would not fit side by side."""
        left, _, right, _ = self.box
        bins = max(1, min(9, int((right - left) / (PT * SCALE) / 30)))
        while True:
            ticks, decimals = nice_ticks(*xlim, bins)
            wide = sum(self.canvas.draw.textlength(label(v, decimals), font=f) + 8 * SCALE for v in ticks)
            if wide <= right - left or bins == 1:
                return ticks, decimals
            bins -= 1

    def _draw_legend(self) -> None:
        """The labelled lines' colors and labels in a box at the upper right."""
        entries = [(lab, color) for _, _, lab, color, _ in self.lines if lab]
        if not entries:
            return
        d, f, (_, top, right, _) = self.canvas.draw, font(7), self.box
        row, sample, pad = 11 * SCALE, 18 * SCALE, 4 * SCALE
        width = sample + 3 * pad + max(d.textlength(lab, font=f) for lab, _ in entries)
        x0, y0 = right - width - pad, top + pad
        d.rectangle([x0, y0, x0 + width, y0 + pad * 2 + row * len(entries)], fill=(255, 255, 255),
                    outline=LEGEND_EDGE, width=SCALE)
        for i, (lab, color) in enumerate(entries):
            cy = y0 + pad + row * i + row / 2
            d.line([(x0 + pad, cy), (x0 + pad + sample, cy)], fill=color, width=2 * SCALE)
            d.text((x0 + 2 * pad + sample, cy), lab, font=f, fill=FRAME, anchor="lm")


class Canvas:
    """A white image of `width` x `height` inches at 90 dpi holding Axes at figure fractions (as matplotlib's)."""

    def __init__(self, width_in: float, height_in: float):
        self.size = (round(width_in * 90), round(height_in * 90))
        self.image = Image.new("RGB", (self.size[0] * SCALE, self.size[1] * SCALE), (255, 255, 255))
        self.draw = ImageDraw.Draw(self.image)
        self.axes: list[Axes] = []

    def subplots(self, n: int, left: float, right: float, bottom: float, top: float, wspace: float = 0.0) -> list[Axes]:
        """n axes in a row within the figure fractions given, `wspace` of an axes' width between two (matplotlib's
        subplots_adjust)."""
        w, h = self.image.size
        each = (right - left) / (n + wspace * (n - 1))
        for i in range(n):
            x0 = left + i * each * (1 + wspace)
            self.axes.append(Axes(self, (x0 * w, (1 - top) * h, (x0 + each) * w, (1 - bottom) * h)))
        return self.axes[-n:]

    def vertical_text(self, x: float, y: float, text: str, f: ImageFont.FreeTypeFont) -> None:
        """`text` turned a quarter left (it reads upward), ending at x, centred on y."""
        if not text:
            return
        x0, y0, x1, y1 = f.getbbox(text)
        mask = Image.new("L", (x1 - x0 + 2, y1 - y0 + 2), 0)
        ImageDraw.Draw(mask).text((-x0 + 1, -y0 + 1), text, font=f, fill=255)
        mask = mask.rotate(90, expand=True)
        self.image.paste(FRAME, (round(x - mask.size[0]), round(y - mask.size[1] / 2)), mask)

    def save(self, path: Path) -> Path:
        """Draw every axes and write the PNG at its size (the supersampled image halved)."""
        for ax in self.axes:
            ax.draw()
        self.image.reduce(SCALE).save(path, format="PNG", **PNG)
        return path
