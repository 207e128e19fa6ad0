"""A small chart canvas drawn with Pillow: axes with ticks, grid, title, labels; lines, steps, points, dashed level
lines across the axes; a legend (at a fixed corner or where the data leaves room), a figure title; saved as PNG.
Every plot the project writes is drawn here (matplotlib costs a third of a second to import and as long again to lay
out and draw). Drawn at twice the size and halved, for smooth lines."""
from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
from PIL import Image, ImageColor, ImageDraw, ImageFont

from sim.report.marks import marker, polyline
from sim.report.pngfile import write_png

SCALE = 2  # supersampling: drawn at twice the size, then halved (antialiased lines)
COLORS = ((31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189), (140, 86, 75))  # tab10
WHITE, GRID, FRAME, LEGEND_EDGE = (255, 255, 255), (231, 231, 231), (0, 0, 0), (204, 204, 204)
# matplotlib's legend locations in the order its "best" tries them: (x, y) of the box as fractions of the free room
LOCATIONS = {"upper right": (1, 0), "upper left": (0, 0), "lower left": (0, 1), "lower right": (1, 1),
             "center left": (0, .5), "center right": (1, .5), "lower center": (.5, 1), "upper center": (.5, 0),
             "center": (.5, .5)}


@lru_cache(maxsize=16)
def font(size_pt: float, dpi: float = 90) -> ImageFont.FreeTypeFont:
    """DejaVu Sans (matplotlib's font: its copy where matplotlib is installed, else the system's) at `size_pt` on a
    `dpi` canvas drawn at SCALE, else Pillow's default font."""
    px = round(size_pt * dpi / 72 * SCALE)
    spec = importlib.util.find_spec("matplotlib")
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        ttf = Path(folder) / "mpl-data" / "fonts" / "ttf" / "DejaVuSans.ttf"
        if ttf.is_file():
            return ImageFont.truetype(str(ttf), px)
    try:
        return ImageFont.truetype("DejaVuSans.ttf", px)  # Pillow looks in the system's font folders
    except OSError:
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


def rgb(color: str | tuple) -> tuple:
    """An (r, g, b) tuple of a color given as one or as a name or "#rrggbb"."""
    return ImageColor.getrgb(color) if isinstance(color, str) else tuple(color)


@dataclass
class Series:
    """One thing drawn on an Axes: a line (markers at its points or not), points alone, or a level line across the
    axes ("hline" at y[0], "vline" at x[0]). Widths and marker sizes in points; z orders the drawing."""

    kind: str
    x: np.ndarray
    y: np.ndarray
    label: str | None
    color: tuple
    lw: float = 1.5
    dashed: bool = False
    marker: str | None = None
    size: float = 0.0
    z: float = 2

    def extent(self) -> tuple[np.ndarray, np.ndarray]:
        """The x and y values the axes' limits take in: a line's or the points' where both are finite (matplotlib
        leaves out a point with a NaN coordinate), a level line's one value."""
        if self.kind in ("hline", "vline"):
            return self.x, self.y
        keep = np.isfinite(self.x) & np.isfinite(self.y)
        return self.x[keep], self.y[keep]


class Axes:
    """One chart on a Canvas: series added, then drawn with ticks, grid, labels and legend."""

    def __init__(self, canvas: Canvas, box: tuple[float, float, float, float]):
        self.canvas, self.box = canvas, box  # left, top, right, bottom in pixels
        self.series: list[Series] = []
        self.title = self.xlabel = self.ylabel = ""
        self.legend, self.legend_pt, self.legend_loc = False, 7.0, "upper right"  # loc: a LOCATIONS key or "best"
        self._cycle = 0

    def _next_color(self, color: str | tuple | None, alpha: float) -> tuple:
        """`color`, else the next of COLORS, `alpha` of it over the white."""
        if color is None:
            color, self._cycle = COLORS[self._cycle % len(COLORS)], self._cycle + 1
        return tuple(round(c * alpha + 255 * (1 - alpha)) for c in rgb(color))

    def plot(self, x: np.ndarray, y: np.ndarray, label: str | None = None, lw: float = 1.5, alpha: float = 1.0,
             color: str | tuple | None = None, marker: str | None = None, ms: float = 6.0) -> None:
        """A line through (x, y) in `color` or the next one, `alpha` of it over the white; with `marker` ("o" or "*")
        one `ms` points across at each point."""
        self.series.append(Series("line", np.asarray(x, float), np.asarray(y, float), label,
                                  self._next_color(color, alpha), lw, marker=marker, size=ms))

    def step(self, x: np.ndarray, y: np.ndarray, label: str | None = None, lw: float = 1.5, alpha: float = 1.0) -> None:
        """y[i] held from x[i] to x[i + 1] (matplotlib's step where="post")."""
        x, y = np.asarray(x, float), np.asarray(y, float)
        self.plot(np.repeat(x, 2)[1:], np.repeat(y, 2)[:-1], label, lw, alpha)

    def scatter(self, x, y, label: str | None = None, s: float = 36.0, color: str | tuple | None = None,
                marker: str = "o", z: float = 1) -> None:
        """Points at (x, y) without a line, each of area `s` square points (matplotlib's scatter)."""
        self.series.append(Series("points", np.asarray(x, float), np.asarray(y, float), label,
                                  self._next_color(color, 1.0), marker=marker, size=math.sqrt(s), z=z))

    def hline(self, y: float, label: str | None = None, color: str | tuple = FRAME, lw: float = 1.0,
              dashed: bool = True) -> None:
        """A level line across the axes at `y` (matplotlib's axhline); its y counts in the limits."""
        self.series.append(Series("hline", np.zeros(0), np.array([y], float), label, rgb(color), lw, dashed))

    def vline(self, x: float, label: str | None = None, color: str | tuple = FRAME, lw: float = 1.0,
              dashed: bool = True) -> None:
        """An upright line across the axes at `x` (matplotlib's axvline); its x counts in the limits."""
        self.series.append(Series("vline", np.array([x], float), np.zeros(0), label, rgb(color), lw, dashed))

    def draw(self) -> None:
        """Grid, frame, ticks and their labels, the series, titles and the legend."""
        left, top, right, bottom = self.box
        extents = [s.extent() for s in self.series]
        xlim, ylim = limits([x for x, _ in extents]), limits([y for _, y in extents])
        sx, sy = (right - left) / (xlim[1] - xlim[0]), (bottom - top) / (ylim[1] - ylim[0])
        yticks, yd = self._draw_ticks(xlim, ylim, sx, sy)
        for s in sorted(self.series, key=lambda s: s.z):
            self._draw_series(s, left + (s.x - xlim[0]) * sx, bottom - (s.y - ylim[0]) * sy)
        if self.legend:
            self._draw_legend()
        self._draw_labels(max((self.canvas.draw.textlength(label(v, yd), font=self.canvas.font(10)) for v in yticks),
                              default=0))

    def _draw_ticks(self, xlim: tuple[float, float], ylim: tuple[float, float], sx: float, sy: float
                    ) -> tuple[list[float], int]:
        """The grid and the ticks with their labels; returns the y ticks and their decimals."""
        d, (left, top, right, bottom), pt = self.canvas.draw, self.box, self.canvas.px
        small, tick = self.canvas.font(10), 3.5 * pt
        # as many intervals as labels of 10 points fit, three font sizes apart across (_xticks), two up, at most 9
        xticks, xd = self._xticks(xlim, small)
        yticks, yd = nice_ticks(*ylim, max(1, min(9, int((bottom - top) / pt / 20))))
        for v in xticks:
            px = left + (v - xlim[0]) * sx
            d.line([(px, top), (px, bottom)], fill=GRID, width=SCALE)
            d.line([(px, bottom), (px, bottom + tick)], fill=FRAME, width=SCALE)
            d.text((px, bottom + tick + 1.6 * pt), label(v, xd), font=small, fill=FRAME, anchor="mt")
        for v in yticks:
            py = bottom - (v - ylim[0]) * sy
            d.line([(left, py), (right, py)], fill=GRID, width=SCALE)
            d.line([(left - tick, py), (left, py)], fill=FRAME, width=SCALE)
            d.text((left - tick - 1.6 * pt, py), label(v, yd), font=small, fill=FRAME, anchor="rm")
        return yticks, yd

    def _draw_series(self, s: Series, px: np.ndarray, py: np.ndarray) -> None:
        """One series at pixel positions (px, py), level lines from one side of the axes to the other."""
        d, (left, top, right, bottom), pt = self.canvas.draw, self.box, self.canvas.px
        if s.kind == "hline":
            px, py = np.array([left, right]), np.repeat(py, 2)
        elif s.kind == "vline":
            px, py = np.repeat(px, 2), np.array([bottom, top])
        keep = np.isfinite(px) & np.isfinite(py)
        pts = np.column_stack((px[keep], py[keep]))
        if s.kind != "points":
            polyline(self.canvas.image, pts, s.color, max(1, round(s.lw * pt)), s.dashed)
        for x, y in pts if s.marker else ():
            marker(d, x, y, s.marker, s.size * pt, s.color)

    def _draw_labels(self, ytick_width: float) -> None:
        """The frame, the title above, the x label below and the y label left of the y ticks' labels."""
        d, (left, top, right, bottom), pt = self.canvas.draw, self.box, self.canvas.px
        small, tick = self.canvas.font(10), 3.5 * pt
        d.rectangle([left, top, right, bottom], outline=FRAME, width=SCALE)
        d.text(((left + right) / 2, top - 4.8 * pt), self.title, font=self.canvas.font(12), fill=FRAME, anchor="mb")
        d.text(((left + right) / 2, bottom + tick + 14.4 * pt), self.xlabel, font=small, fill=FRAME, anchor="mt")
        self.canvas.vertical_text(left - tick - ytick_width - 6.4 * pt, (top + bottom) / 2, self.ylabel, small)

    def _xticks(self, xlim: tuple[float, float], f: ImageFont.FreeTypeFont) -> tuple[list[float], int]:
        """The x ticks: fewer than matplotlib's count where their labels would not fit side by side."""
        left, _, right, _ = self.box
        bins = max(1, min(9, int((right - left) / self.canvas.px / 30)))
        while True:
            ticks, decimals = nice_ticks(*xlim, bins)
            wide = sum(self.canvas.draw.textlength(label(v, decimals), font=f) + 6.4 * self.canvas.px for v in ticks)
            if wide <= right - left or bins == 1:
                return ticks, decimals
            bins -= 1

    def _legend_at(self, width: float, height: float) -> tuple[float, float]:
        """The legend box's top left corner: at legend_loc, or ("best") where it covers the least drawn ink, ties
        to the earlier of LOCATIONS."""
        left, top, right, bottom = self.box
        gap = round(0.46 * self.legend_pt * self.canvas.px)
        spots = [(left + gap + fx * (right - left - width - 2 * gap), top + gap + fy * (bottom - top - height - 2 * gap))
                 for fx, fy in (LOCATIONS.values() if self.legend_loc == "best" else [LOCATIONS[self.legend_loc]])]
        if len(spots) == 1:
            return spots[0]
        image = self.canvas.image

        def covered(spot: tuple[float, float]) -> int:
            # only the box's own pixels, within the image (a crop past its edge would be padded with black)
            x0, y0 = max(0, round(spot[0])), max(0, round(spot[1]))
            x1, y1 = min(image.size[0], round(spot[0]) + round(width) + 1), min(image.size[1], round(spot[1]) + round(height) + 1)
            ink = np.asarray(image.crop((x0, y0, max(x0, x1), max(y0, y1))))
            return int(((ink != WHITE).any(axis=2) & (ink != GRID).any(axis=2)).sum())

        return min(spots, key=covered)

    def _draw_legend(self) -> None:
        """The labelled series' samples and labels in a box (see _legend_at)."""
        entries = [s for s in self.series if s.label]
        if not entries:
            return
        d, f, em = self.canvas.draw, self.canvas.font(self.legend_pt), self.legend_pt * self.canvas.px
        row, sample, pad = round(1.26 * em), round(2.06 * em), round(0.46 * em)
        width = sample + 3 * pad + max(d.textlength(s.label, font=f) for s in entries)
        x0, y0 = self._legend_at(width, pad * 2 + row * len(entries))
        d.rectangle([x0, y0, x0 + width, y0 + pad * 2 + row * len(entries)], fill=WHITE, outline=LEGEND_EDGE,
                    width=SCALE)
        for i, s in enumerate(entries):
            cy = y0 + pad + row * i + row / 2
            if s.kind != "points":
                polyline(self.canvas.image, np.array([(x0 + pad, cy), (x0 + pad + sample, cy)]), s.color,
                         max(2 * SCALE, round(s.lw * self.canvas.px)), s.dashed)
            if s.marker:
                marker(d, x0 + pad + sample / 2, cy, s.marker, s.size * self.canvas.px, s.color)
            d.text((x0 + 2 * pad + sample, cy), s.label, font=f, fill=FRAME, anchor="lm")


class Canvas:
    """A white image of `width` x `height` inches at `dpi` holding Axes at figure fractions (as matplotlib's) and an
    optional title above them all (`title`, `title_pt` points)."""

    def __init__(self, width_in: float, height_in: float, dpi: float = 90):
        self.size = (round(width_in * dpi), round(height_in * dpi))
        self.dpi, self.px = dpi, dpi / 72 * SCALE  # px: drawn pixels per point
        self.image = Image.new("RGB", (self.size[0] * SCALE, self.size[1] * SCALE), WHITE)
        self.draw = ImageDraw.Draw(self.image)
        self.axes: list[Axes] = []
        self.title, self.title_pt = "", 12.0

    def font(self, size_pt: float) -> ImageFont.FreeTypeFont:
        """The chart font at `size_pt` points on this canvas."""
        return font(size_pt, self.dpi)

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
        """Draw every axes and the title and write the PNG at its size (the supersampled image halved)."""
        for ax in self.axes:
            ax.draw()
        if self.title:  # matplotlib's suptitle: its top at 98% of the height
            self.draw.text((self.image.size[0] / 2, 0.02 * self.image.size[1]), self.title,
                           font=self.font(self.title_pt), fill=FRAME, anchor="mt")
        return write_png(path, np.asarray(self.image.reduce(SCALE)))
