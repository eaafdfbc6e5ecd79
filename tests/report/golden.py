"""The report of a sink-only synthetic sweep as the committed code wrote it before approximations reached the report
(tests/report/golden/): its text files byte for byte and every figure's sha256, with the matplotlib that drew them.

``python tests/report/golden.py`` rewrites the folder: only ever from a report whose sink-only output is meant to
change, and say so in the commit.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
import tempfile
from pathlib import Path

import matplotlib

sys.path.insert(0, str(Path(__file__).parent))
from synthetic_sweep import write_sweep  # noqa: E402

GOLDEN = Path(__file__).parent / "golden"
EXTRA_KINDS = ("selfspec", "tuned")  # with documents: paired differences, the frontier and every further figure
IMAGE = re.compile(r'src="data:image/png;base64,[A-Za-z0-9+/=]*"')


def render(outdir: Path) -> dict[str, bytes]:
    """Every file the report writes of the sink-only synthetic sweep in ``outdir``: text files as written (the page
    with its images and the folder's path taken out), figures as their sha256."""
    from alspec_eval.report.build import write_report

    write_sweep(outdir, documents=True, extra_kinds=EXTRA_KINDS)
    out: dict[str, bytes] = {}
    for path in write_report(outdir):
        data = path.read_bytes()
        if path.suffix == ".png":
            out[path.name + ".sha256"] = hashlib.sha256(data).hexdigest().encode() + b"\n"
        elif path.suffix == ".html":
            out[path.name] = IMAGE.sub('src="IMAGE"', data.decode()).replace(str(outdir), "OUTDIR").encode()
        else:
            out[path.name] = data
    return out


def recorded() -> tuple[dict[str, bytes], str]:
    """The golden files and the matplotlib version that drew their figures."""
    files = {p.name: p.read_bytes() for p in GOLDEN.iterdir() if p.name != "versions.json"}
    return files, json.loads((GOLDEN / "versions.json").read_text())["matplotlib"]


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        files = render(Path(tmp) / "sweep")
    GOLDEN.mkdir(exist_ok=True)
    for old in GOLDEN.iterdir():
        old.unlink()
    for name, data in files.items():
        (GOLDEN / name).write_bytes(data)
    (GOLDEN / "versions.json").write_text(json.dumps({"matplotlib": matplotlib.__version__}) + "\n")


if __name__ == "__main__":
    main()
