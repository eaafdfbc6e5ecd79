"""The report of a sink-only synthetic sweep as the committed code wrote it before approximations reached the report
(tests/report/golden/): its text files byte for byte and every figure's sha256, with the versions of the packages that
drew them (matplotlib, numpy and pillow: another version of any of them may draw or encode other bytes; a fresh
install of 2026-11-25 drew open_loop_acceptance.png differently from the same code and matplotlib).

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

from importlib.metadata import version

sys.path.insert(0, str(Path(__file__).parent))
from synthetic_sweep import write_sweep

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


DRAWING = ("matplotlib", "numpy", "pillow")


def drawing_versions() -> dict[str, str]:
    return {name: version(name) for name in DRAWING}


def recorded() -> tuple[dict[str, bytes], dict[str, str]]:
    """The golden files and the versions of the packages that drew their figures."""
    files = {p.name: p.read_bytes() for p in GOLDEN.iterdir() if p.name != "versions.json"}
    return files, json.loads((GOLDEN / "versions.json").read_text())


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        files = render(Path(tmp) / "sweep")
    GOLDEN.mkdir(exist_ok=True)
    for old in GOLDEN.iterdir():
        old.unlink()
    for name, data in files.items():
        (GOLDEN / name).write_bytes(data)
    (GOLDEN / "versions.json").write_text(json.dumps(drawing_versions()) + "\n")


if __name__ == "__main__":
    main()
