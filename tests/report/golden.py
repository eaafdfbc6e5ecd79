"""The report of a sink-only synthetic sweep as the committed code wrote it before approximations reached the report
(tests/report/golden/): its text files byte for byte, and for every figure what it draws (``drawn.py``: data,
colours, labels and legends), not its PNG bytes, which differ from one CPU to another (``drawn.py`` says why).

``python tests/report/golden.py`` rewrites the folder: only ever from a report whose sink-only output is meant to
change, and say so in the commit.
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
from pathlib import Path
from unittest import mock

from matplotlib.figure import Figure

sys.path.insert(0, str(Path(__file__).parent))
from drawn import drawn
from synthetic_sweep import write_sweep

GOLDEN = Path(__file__).parent / "golden"
EXTRA_KINDS = ("selfspec", "tuned")  # with documents: paired differences, the frontier and every further figure
IMAGE = re.compile(r'src="data:image/png;base64,[A-Za-z0-9+/=]*"')


def render(outdir: Path) -> dict[str, bytes]:
    """Every file the report writes of the sink-only synthetic sweep in ``outdir``: text files as written (the page
    with its images and the folder's path taken out), figures as what they draw (``NAME.png.json``)."""
    from alspec_eval.report import build

    figures: dict[str, bytes] = {}

    def save(fig: Figure, path: Path) -> Path:
        written = saved(fig, path)
        png = written.read_bytes()  # its size in pixels from the PNG header: the figure's size at the saved dpi
        picture = {"pixels": [int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")], **drawn(fig)}
        figures[path.name + ".json"] = (json.dumps(picture, indent=1, ensure_ascii=False) + "\n").encode()
        return written

    saved = build.save
    write_sweep(outdir, documents=True, extra_kinds=EXTRA_KINDS)
    out: dict[str, bytes] = {}
    with mock.patch.object(build, "save", save):
        paths = build.write_report(outdir)
    for path in paths:
        data = path.read_bytes()
        if path.suffix == ".png":
            out[path.name + ".json"] = figures[path.name + ".json"]
        elif path.suffix == ".html":
            out[path.name] = IMAGE.sub('src="IMAGE"', data.decode()).replace(str(outdir), "OUTDIR").encode()
        else:
            out[path.name] = data
    return out


def recorded() -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in GOLDEN.iterdir()}


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        files = render(Path(tmp) / "sweep")
    GOLDEN.mkdir(exist_ok=True)
    for old in GOLDEN.iterdir():
        old.unlink()
    for name, data in files.items():
        (GOLDEN / name).write_bytes(data)


if __name__ == "__main__":
    main()
