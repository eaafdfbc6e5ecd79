"""What a figure draws, as plain data: every axes' titles, labels, scales and limits, and every line, marker
collection, image, bar, text and legend entry in it, with its colour and its data rounded to 6 significant digits.

A figure's PNG bytes are not a fingerprint of its content: numpy's SIMD dispatch takes other code paths for
``log10`` on a CPU with AVX-512 than on one with AVX2 only (1 ulp apart on 6 of OPEN_LOOP_GRID's 81 points), and
Agg rasterises a log axis' curves 1 ulp apart into other pixels. What is drawn is the same on every machine, and
a changed curve, colour, label or dropped series changes it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.axis import Axis
from matplotlib.collections import Collection, LineCollection
from matplotlib.colors import to_hex
from matplotlib.figure import Figure
from matplotlib.legend import Legend
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Rectangle
from matplotlib.text import Annotation, Text
from matplotlib.ticker import FixedFormatter


def _num(values: Any) -> Any:
    """Numbers rounded to 6 significant digits (NaN as None), in nested lists."""
    array = np.asarray(values, dtype=float)
    if array.ndim == 0:
        v = float(array)
        return None if np.isnan(v) else float(f"{v:.6g}")
    return [_num(v) for v in array]


def _colours(rgba: Any) -> list[str]:
    return [to_hex(c, keep_alpha=True) for c in np.atleast_2d(rgba)] if len(rgba) else []


def _text(text: Text) -> dict[str, Any] | None:
    if not text.get_visible() or not text.get_text():
        return None
    out: dict[str, Any] = {"text": text.get_text(), "colour": to_hex(text.get_color()), "size": text.get_fontsize()}
    if isinstance(text, Annotation):
        out["at"] = _num(text.xy)  # the point it labels; its offset follows the font's extents, not the data
    elif text.axes is not None and text.get_transform() == text.axes.transData:
        out["at"] = _num(text.get_position())
    return out


def _handle_colour(handle: Any) -> str | None:
    if isinstance(handle, Line2D):
        return to_hex(handle.get_color(), keep_alpha=True)
    if isinstance(handle, Patch):
        return to_hex(handle.get_facecolor(), keep_alpha=True)
    if isinstance(handle, Collection):
        return next(iter(_colours(handle.get_facecolor()) + _colours(handle.get_edgecolor())), None)
    return None


def _legend(legend: Legend | None) -> dict[str, Any] | None:
    if legend is None:
        return None
    return {"title": legend.get_title().get_text(), "entries": [t.get_text() for t in legend.get_texts()],
            "colours": [_handle_colour(h) for h in legend.legend_handles]}


def _collection(c: Collection) -> dict[str, Any]:
    out: dict[str, Any] = {"kind": type(c).__name__, "label": c.get_label(),
                           "face": _colours(c.get_facecolor()), "edge": _colours(c.get_edgecolor())}
    if isinstance(c, LineCollection):
        out["segments"] = [_num(s) for s in c.get_segments()]
    elif len(c.get_offsets()):
        out["offsets"] = _num(c.get_offsets())
    if c.get_array() is not None:
        out["array"] = _num(np.ma.filled(np.ma.asarray(c.get_array(), dtype=float), np.nan))
    return out


def _fixed_ticks(axis: Axis) -> list[str]:
    """The tick labels the code set; automatic ones are the library's to place, version to version."""
    return [t.get_text() for t in axis.get_ticklabels()] if isinstance(axis.get_major_formatter(),
                                                                       FixedFormatter) else []


def _axes(ax: Axes) -> dict[str, Any]:
    return {
        "title": [ax.get_title(loc) for loc in ("left", "center", "right")],
        "xlabel": ax.get_xlabel(), "ylabel": ax.get_ylabel(),
        "scale": [ax.get_xscale(), ax.get_yscale()],
        "xlim": _num(ax.get_xlim()), "ylim": _num(ax.get_ylim()),
        "xticks": _fixed_ticks(ax.xaxis), "yticks": _fixed_ticks(ax.yaxis),
        "lines": [{"label": line.get_label(), "colour": to_hex(line.get_color(), keep_alpha=True),
                   "style": [line.get_linestyle(), line.get_marker(), line.get_linewidth(), line.get_markersize()],
                   "xy": _num(line.get_xydata())} for line in ax.get_lines() if line.get_visible()],
        "collections": [_collection(c) for c in ax.collections if c.get_visible()],
        "images": [{"cmap": im.get_cmap().name, "clim": _num(im.get_clim()),
                    "array": _num(np.ma.filled(np.ma.asarray(im.get_array(), dtype=float), np.nan))}
                   for im in ax.get_images()],
        "bars": [{"xywh": _num([p.get_x(), p.get_y(), p.get_width(), p.get_height()]),
                  "colour": to_hex(p.get_facecolor(), keep_alpha=True)}
                 for p in ax.patches if isinstance(p, Rectangle) and p.get_visible()],
        "texts": [t for t in map(_text, ax.texts) if t is not None],
        "legend": _legend(ax.get_legend()),
    }


def drawn(fig: Figure) -> dict[str, Any]:
    """Everything the figure draws that the code decides, in the order the code drew it."""
    fig.canvas.draw()  # ticks, labels and layout as saved
    return {"size": _num(fig.get_size_inches()),
            "suptitle": fig._suptitle.get_text() if fig._suptitle is not None else None,
            "legends": [_legend(legend) for legend in fig.legends],
            "axes": [_axes(ax) for ax in fig.axes if ax.get_visible()]}
