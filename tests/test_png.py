"""The report's PNG canvas (sim/report/png.py): round ticks as matplotlib places them, the lines drawn where the data
is, the plots of a run written at their sizes, and charts with no data."""
from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from sim.report.png import COLORS, Canvas, font, label, limits, nice_ticks


@pytest.mark.parametrize("lo, hi, bins, ticks, decimals", [
    (27.0, 185.0, 7, [50.0, 75.0, 100.0, 125.0, 150.0, 175.0], 0),
    (-0.05, 1.05, 9, [0.0, 0.2, 0.4, 0.6, 0.8, 1.0], 1),
    (-125.0, 2625.0, 9, [0.0, 500.0, 1000.0, 1500.0, 2000.0, 2500.0], 0),
    (-0.95, 19.95, 9, [0.0, 2.5, 5.0, 7.5, 10.0, 12.5, 15.0, 17.5], 1),
])
def test_ticks_at_round_steps(lo, hi, bins, ticks, decimals):
    got, d = nice_ticks(lo, hi, bins)
    assert got == pytest.approx(ticks) and d == decimals
    assert [label(v, d) for v in got][:2] == [f"{ticks[0]:.{decimals}f}", f"{ticks[1]:.{decimals}f}"]


def test_limits_pad_the_data_and_default_without_it():
    assert limits([np.array([0.0, 10.0])]) == pytest.approx((-0.5, 10.5))
    assert limits([np.array([np.nan])]) == (0.0, 1.0)
    lo, hi = limits([np.array([3.0, 3.0])])
    assert lo < 3.0 < hi


def test_a_line_is_drawn_where_its_data_is(tmp_path):
    fig = Canvas(4, 3)
    ax = fig.subplots(1, left=0.1, right=0.9, bottom=0.1, top=0.9)[0]
    ax.plot(np.array([0.0, 1.0]), np.array([0.0, 0.0]))  # a level line along the bottom of the data
    ax.plot(np.array([0.0, 1.0]), np.array([1.0, 1.0]))
    image = np.asarray(Image.open(fig.save(tmp_path / "x.png")).convert("RGB")).astype(int)
    assert image.shape == (270, 360, 3)

    def rows_of(color):
        near = (np.abs(image - np.array(color)).sum(axis=2) < 60)
        return np.flatnonzero(near.sum(axis=1) > 100)

    low, high = rows_of(COLORS[0]), rows_of(COLORS[1])
    assert len(low) and len(high) and low.min() > high.max()  # the first line below the second, both drawn across


def test_empty_data_still_draws_a_chart(tmp_path):
    fig = Canvas(4, 3)
    ax = fig.subplots(2, left=0.1, right=0.9, bottom=0.2, top=0.9, wspace=0.3)[0]
    ax.plot(np.zeros(0), np.zeros(0), label="nothing")
    ax.title, ax.xlabel, ax.ylabel, ax.legend = "empty", "ms", "fraction", True
    assert Image.open(fig.save(tmp_path / "empty.png")).size == (360, 270)


def test_x_labels_fit_side_by_side():
    fig = Canvas(4, 3)
    ax = fig.subplots(1, left=0.2, right=0.95, bottom=0.2, top=0.9)[0]
    ticks, decimals = ax._xticks((1e-5, 3e-5), font(10))
    widths = [fig.draw.textlength(label(v, decimals), font=font(10)) for v in ticks]
    assert len(ticks) >= 2 and sum(widths) < ax.box[2] - ax.box[0]
    assert label(2e-5, decimals) == "2e-05"


def near(image: np.ndarray, color) -> np.ndarray:
    """Where the image has `color` (within antialiasing's rounding), as a boolean mask."""
    return np.abs(image - np.array(color)).sum(axis=2) < 12


def test_points_stand_alone_and_level_lines_are_dashed(tmp_path):
    fig = Canvas(4, 3, dpi=110)
    ax = fig.subplots(1, left=0.1, right=0.9, bottom=0.1, top=0.9)[0]
    ax.scatter([0.0, 1.0], [0.5, 0.5], s=64, color=COLORS[0])
    ax.vline(2.0, color=COLORS[1])  # past the points: the x limits take it in, its line near the right edge
    ax.hline(0.5, color=COLORS[2], dashed=False)
    image = np.asarray(Image.open(fig.save(tmp_path / "x.png")).convert("RGB")).astype(int)
    assert image.shape == (330, 440, 3)  # 4 x 3 inches at 110 dpi
    left, top, right, bottom = (round(v / 2) for v in ax.box)
    dashed = near(image, COLORS[1]).any(axis=0)
    column = int(np.flatnonzero(dashed)[0])
    assert right - 0.1 * (right - left) < column < right
    inked = near(image[top + 4:bottom - 4, column - 1:column + 2], COLORS[1]).any(axis=1)
    assert 0.5 < inked.mean() < 0.9  # dashes: mostly ink, with gaps
    level = np.flatnonzero(near(image, COLORS[2]).sum(axis=1) > 0.9 * (right - left))
    assert len(level) and abs(level.mean() - (top + bottom) / 2) < 3  # solid, across the axes at y = 0.5
    dots = near(image, COLORS[0])
    assert dots[:, : left + (right - left) // 4].sum() > 20 and dots[:, (right - left) // 2:].sum() > 20
    assert not dots[:, left + (right - left) // 8: left + (right - left) // 3].any()  # no line joins the points


def test_a_point_with_a_nan_coordinate_stays_out_of_the_limits():
    ax = Canvas(4, 3).subplots(1, left=0.1, right=0.9, bottom=0.1, top=0.9)[0]
    ax.scatter([0.0, 1.0, 100.0], [0.0, 1.0, np.nan])
    ax.hline(5.0)
    x, y = ax.series[0].extent()
    assert x.tolist() == [0.0, 1.0] and y.tolist() == [0.0, 1.0]
    assert ax.series[1].extent()[1].tolist() == [5.0]


@pytest.mark.parametrize("loc, side", [("upper right", "right"), ("best", "left")])
def test_the_best_legend_goes_where_the_data_leaves_room(tmp_path, loc, side):
    fig = Canvas(4, 3)
    ax = fig.subplots(1, left=0.1, right=0.9, bottom=0.1, top=0.9)[0]
    x = np.linspace(0.5, 1.0, 60)
    ax.plot(x, np.arange(60) % 2, label="zigzag")
    ax.plot([0.0], [0.5], label="point")  # stretches the x axis to 0: the left half stays empty
    ax.legend, ax.legend_loc = True, loc
    image = np.asarray(Image.open(fig.save(tmp_path / "x.png")).convert("RGB")).astype(int)
    left, top, right, bottom = (round(v / 2) for v in ax.box)
    edge = left + np.flatnonzero(near(image[top:bottom, left:right], (204, 204, 204)).sum(axis=0) > 15)  # box sides
    assert len(edge)
    middle = (left + right) / 2
    assert (edge > middle).all() if side == "right" else (edge < middle).all()


def test_a_title_over_the_axes(tmp_path):
    fig = Canvas(4, 3)
    fig.subplots(1, left=0.1, right=0.9, bottom=0.1, top=0.85)
    blank = np.asarray(Image.open(fig.save(tmp_path / "a.png")).convert("L"))
    fig = Canvas(4, 3)
    fig.subplots(1, left=0.1, right=0.9, bottom=0.1, top=0.85)
    fig.title, fig.title_pt = "a title", 10
    titled = np.asarray(Image.open(fig.save(tmp_path / "b.png")).convert("L"))
    assert (blank[:25] == 255).all() and (titled[:25] < 128).any()


def test_a_font_without_matplotlib(monkeypatch):
    import importlib.util

    from PIL import ImageFont

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert font.__wrapped__(10).getlength("0.5") > 0  # the system's DejaVu Sans, found by Pillow
    truetype = ImageFont.truetype

    def no_file(source, *args, **kwargs):
        if isinstance(source, str):
            raise OSError("cannot open resource")
        return truetype(source, *args, **kwargs)

    monkeypatch.setattr(ImageFont, "truetype", no_file)
    assert font.__wrapped__(10, 110).getlength("0.5") > 0  # no font file anywhere: Pillow's own


def test_png_file_decodes_to_its_pixels(tmp_path):
    from sim.report.pngfile import write_png

    rgb = np.random.default_rng(0).integers(0, 256, (37, 53, 3), dtype=np.uint8)  # differences that wrap mod 256
    rgb[10:20] = 255
    back = np.asarray(Image.open(write_png(tmp_path / "x.png", rgb)))
    assert back.dtype == np.uint8 and np.array_equal(back, rgb)


def steps(seed: int, n: int, size: tuple[int, int]) -> np.ndarray:
    """A step plot's corners through random points across a `size` image, a little past its edges."""
    rng = np.random.default_rng(seed)
    x = np.sort(rng.uniform(-5, size[0] + 5, n))
    y = rng.integers(-5, size[1] + 5, n).astype(float) + rng.uniform(0, 1, n)
    return np.column_stack((np.repeat(x, 2)[1:], np.repeat(y, 2)[:-1]))


def inked(draw_with, size: tuple[int, int] = (300, 150)) -> np.ndarray:
    """The pixels `draw_with(image)` inks on a white image."""
    image = Image.new("RGB", size, (255, 255, 255))
    draw_with(image)
    return np.asarray(image)


@pytest.mark.parametrize("width", [1, 2, 3, 4])
def test_polyline_inks_the_pixels_pillow_would(width):
    from PIL import ImageDraw

    from sim.report.marks import polyline, vertices

    pts = steps(width, 1500, (300, 150))
    pts = np.vstack((pts, [(60.5, 140.2), (60.9, 140.7), (61.0, 10.0), (61.4, 145.0), (10.0, 145.0)]))  # back again
    pillow = inked(lambda image: ImageDraw.Draw(image).line(pts.ravel().tolist(), fill=(31, 119, 180), width=width,
                                                            joint="curve"))
    ours = inked(lambda image: polyline(image, pts, (31, 119, 180), width, dashed=False))
    assert len(vertices(pts)) < len(pts) / 2 and np.array_equal(pillow, ours)


@pytest.mark.parametrize("width", [1, 2, 3, 4])
def test_a_long_step_plot_painted_as_pillow_draws_it(width):
    from PIL import ImageDraw

    from sim.report.marks import vertices
    from sim.report.strokes import paint

    corners = vertices(steps(10 + width, 700, (300, 150)))
    pillow = inked(lambda image: ImageDraw.Draw(image).line(corners.ravel().tolist(), fill=(214, 39, 40),
                                                            width=width, joint="curve"))
    ours = inked(lambda image: assert_painted(paint(image, corners, (214, 39, 40), width)))
    assert np.array_equal(pillow, ours)
    bent = np.vstack((corners, corners[-1] + (3.0, 4.0)))  # a slanted segment: left to Pillow
    assert not paint(Image.new("RGB", (300, 150)), bent, (0, 0, 0), width)
    assert not paint(Image.new("RGB", (300, 150)), corners, (0, 0, 0), 6)  # rounded joints


def assert_painted(done: bool) -> None:
    assert done
