"""One convention for the alspec-* commands: a wrong command line, a missing input file or folder among it,
exits 2 (argparse's status) with one line on stderr that starts with the command's name."""

from __future__ import annotations

import importlib

import pytest

MISSING = "/nonexistent/alspec"
CASES = [
    ("alspec-sweep", "alspec_eval.sweep.cli", [f"{MISSING}/sweep.yaml"]),
    ("alspec-tune", "alspec_eval.tune.cli", [f"{MISSING}/sweep.yaml"]),
    ("alspec-niah", "alspec_eval.niah.cli", ["--model_args", f"pretrained={MISSING}/model"]),
    ("alspec-report", "alspec_eval.report.cli", [f"{MISSING}/sweep_out"]),
    ("alspec-latency", "alspec_eval.latency_cli", ["--latency", f"{MISSING}/table.yaml", "--hit-rate", "0.5"]),
    ("alspec-check-approx", "alspec_eval.approx_check.cli", [f"{MISSING}.module:Class"]),
]


@pytest.mark.parametrize(("program", "module", "argv"), CASES, ids=[c[0] for c in CASES])
def test_a_missing_input_exits_2_in_one_line(program, module, argv, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    try:
        status = importlib.import_module(module).main(argv)
    except SystemExit as exit_:
        status = exit_.code
    err = capsys.readouterr().err
    assert status == 2, (status, err)
    assert err.startswith(f"{program}: ") and err.count("\n") == 1 and MISSING in err, err
