"""The console summary's tables as plain text: aligned columns, no terminal library."""
from sim.report.text_table import text_table


def test_columns_line_up_whatever_the_cells_widths():
    text = text_table(["latency (ms)", "p50"], [["TTFT", "59.8"], ["E2E", "1678.5"]], title="a title")
    lines = text.splitlines()
    assert lines[0] == "a title".center(len(lines[1])).rstrip()
    assert len({len(line) for line in lines[1:]}) == 1  # every row as wide as the box
    assert lines[2] == "┃ latency (ms) ┃ p50    ┃" and lines[5] == "│ E2E          │ 1678.5 │"
    bars = {i for i, c in enumerate(lines[1]) if c in "┏┳┓"}
    assert all({i for i, c in enumerate(line) if c in "┃│┡╇┩└┴┘"} == bars for line in lines[2:])

