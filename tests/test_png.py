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
