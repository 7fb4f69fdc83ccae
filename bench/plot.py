"""A dependency-free SVG grouped bar chart (with optional min..max whiskers) for benchmark results."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from xml.sax.saxutils import escape

#: fill colours of the series, in order (colour-blind safe, Okabe-Ito)
PALETTE = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#000000")
_CHAR_WIDTH = 0.6  # of the font size: a rough average width of a sans-serif character, for layout


def nice_ceiling(value: float) -> float:
    """The smallest of 1, 2, 2.5, 5 times a power of ten that is at least `value` (an axis top)."""
    if value <= 0:
        return 1.0
    power = 10.0 ** math.floor(math.log10(value))
    return next(float(m * power) for m in (1, 2, 2.5, 5, 10) if m * power >= value * (1 - 1e-9))


def _fmt(value: float) -> str:
    return f"{value:.0f}" if value >= 100 else f"{value:.3g}"


def _text(x: float, y: float, content: str, size: int = 12, anchor: str = "start", extra: str = "") -> str:
    return (f'<text x="{x:.1f}" y="{y:.1f}" font-family="sans-serif" font-size="{size}" '
            f'text-anchor="{anchor}"{extra}>{escape(content)}</text>')


def _legend_rows(series: Sequence[str], width: float, size: int) -> list[list[tuple[int, str]]]:
    """Series (index, name) laid out in rows no wider than `width`."""
    rows: list[list[tuple[int, str]]] = [[]]
    used = 0.0
    for index, name in enumerate(series):
        need = 20 + len(name) * size * _CHAR_WIDTH + 16
        if rows[-1] and used + need > width:
            rows.append([])
            used = 0.0
        rows[-1].append((index, name))
        used += need
    return rows


def bar_chart(
    groups: Sequence[str], series: Sequence[str], values: Mapping[tuple[str, str], float], *, title: str,
    ylabel: str, ranges: Mapping[tuple[str, str], tuple[float, float]] | None = None,
    width: int = 760, height: int = 440,
) -> str:
    """SVG text: one cluster of bars per group, one bar per series; values[(group, series)], missing
    pairs are left out; `ranges` draws a min..max whisker on a bar."""
    if not values:
        raise ValueError("nothing to plot")
    ranges = ranges or {}
    legend = _legend_rows(series, width - 80, 12)
    left, right, top, bottom = 70, 20, 40, 40 + 18 * len(legend)
    plot_w, plot_h = width - left - right, height - top - bottom
    y_top = nice_ceiling(max([*values.values(), *(hi for _, hi in ranges.values())]))

    def y(value: float) -> float:
        return top + plot_h * (1 - value / y_top)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           _text(width / 2, 22, title, size=15, anchor="middle")]
    for i in range(6):  # horizontal grid lines and their labels
        tick = y_top * i / 5
        out.append(f'<line x1="{left}" x2="{left + plot_w}" y1="{y(tick):.1f}" y2="{y(tick):.1f}" stroke="#ddd"/>')
        out.append(_text(left - 6, y(tick) + 4, _fmt(tick), anchor="end"))
    out.append(_text(0, 0, ylabel, anchor="middle", extra=f' transform="translate(18 {top + plot_h / 2}) rotate(-90)"'))
    slot = plot_w / max(len(groups), 1)
    bar = slot * 0.8 / max(len(series), 1)
    for g, group in enumerate(groups):
        x0 = left + g * slot + slot * 0.1
        for s, name in enumerate(series):
            key = (group, name)
            if key not in values:
                continue
            value, x = values[key], x0 + s * bar
            out.append(f'<rect x="{x:.1f}" y="{y(value):.1f}" width="{bar * 0.9:.1f}" height="{y(0) - y(value):.1f}" '
                       f'fill="{PALETTE[s % len(PALETTE)]}"><title>{escape(group)}, {escape(name)}: '
                       f'{_fmt(value)}</title></rect>')
            mid = x + bar * 0.45
            low, high = ranges.get(key, (value, value))
            if key in ranges:
                out.append(f'<line x1="{mid:.1f}" x2="{mid:.1f}" y1="{y(low):.1f}" y2="{y(high):.1f}" stroke="#333"/>')
            out.append(_text(mid, min(y(value), y(high)) - 4, _fmt(value), size=10, anchor="middle"))
        out.append(_text(left + (g + 0.5) * slot, top + plot_h + 18, group, anchor="middle"))
    out.append(f'<line x1="{left}" x2="{left + plot_w}" y1="{y(0):.1f}" y2="{y(0):.1f}" stroke="#333"/>')
    for r, row in enumerate(legend):  # under the axis, as many rows as the names need
        x, row_y = float(left), top + plot_h + 32 + 18 * r
        for s, name in row:
            out.append(f'<rect x="{x:.1f}" y="{row_y:.1f}" width="12" height="12" fill="{PALETTE[s % len(PALETTE)]}"/>')
            out.append(_text(x + 16, row_y + 10, name))
            x += 20 + len(name) * 12 * _CHAR_WIDTH + 16
    out.append("</svg>")
    return "\n".join(out) + "\n"


def write_svg(path: str | Path, svg: str) -> Path:
    """Write `svg` to `path`, creating its folder; the path."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(svg)
    return target
