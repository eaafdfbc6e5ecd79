"""alspec-niah end to end on a tiny model: a resumable needle sweep and its figures."""

from __future__ import annotations

import json

import pytest

from alspec_eval.approx_check.models import save_tiny
from alspec_eval.niah.cli import main

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.mark.slow
def test_needle_sweep_writes_cells_and_figures(tmp_path, capsys):
    model = save_tiny(tmp_path / "model", max_positions=4096)
    out = tmp_path / "niah"
    args = ["--model-args", f"pretrained={model}", "--lengths", "1024", "--depths", "0.2,0.8", "--lambdas", "0.5,1",
            "--window", "16", "--max-gen-toks", "6", "--no-chat", "--gammas", "2", "--approx", "sink,topk",
            "--output", str(out)]
    main(args)
    cells = {p.stem: json.loads(p.read_text()) for p in (out / "cells" / "alspec_niah_single").glob("*.json")}
    assert sorted(cells) == ["baseline", "inf_topk", "lambda_0.5", "lambda_0.5_topk", "lambda_1", "lambda_1_topk",
                             "selfspec_g2", "selfspec_g2_topk", "sink"]
    assert cells["lambda_1_topk"]["approx"] == "topk" and cells["lambda_1_topk"]["alspec"]["config"]["approx"] == "topk"
    assert cells["lambda_1_topk"]["alspec"]["total"]["hit_rate"] > cells["lambda_1"]["alspec"]["total"]["hit_rate"]
    assert [s["alspec"][0]["selfspec"]["gamma"] for s in cells["selfspec_g2"]["sample_log"]] == [2, 2]
    assert cells["selfspec_g2"]["score"] == cells["baseline"]["score"]
    samples = cells["lambda_1"]["sample_log"]
    assert sorted((s["doc"]["max_length"], s["doc"]["depth"]) for s in samples) == [(1024, 0.2), (1024, 0.8)]
    for sample in samples:
        (entry,) = sample["alspec"]
        assert len(entry["accepted_layers_per_token"]) >= 1 and sum(entry["accepted_layers_per_token"]) == entry["accepted"]
    figures = {p.name for p in (out / "figures").iterdir()}
    assert {"alspec_niah_single_needles_vs_lambda.png", "alspec_niah_single_acceptance_per_layer.png",
            "alspec_niah_single_lambda_1_grid.png", "alspec_niah_single_lambda_1_tokens.png",
            "alspec_niah_single_needles_vs_lambda_topk.png", "alspec_niah_single_acceptance_per_layer_topk.png",
            "alspec_niah_single_lambda_1_topk_tokens.png"} <= figures
    written = capsys.readouterr().out
    mtimes = {p: p.stat().st_mtime for p in (out / "cells").rglob("*.json")}
    main(args)  # resumes: every cell exists, nothing is recomputed
    assert {p: p.stat().st_mtime for p in (out / "cells").rglob("*.json")} == mtimes
    assert "needles_vs_lambda" in written


@pytest.mark.parametrize(("flag", "value", "named"), [("--lengths", "1000", "--lengths [1000]"),
                                                      ("--depths", "0.5,1.5", "--depths [1.5]"),
                                                      ("--approx_args", "quest", "--approx_args 'quest' is not NAME=ARGS"),
                                                      ("--approx_args", "quest=page:3", "approx_args={'quest': 'page:3'}"
                                                       " must map approximations of approx (sink)")])
def test_bad_lengths_and_depths_stop_before_loading(tmp_path, capsys, flag, value, named):
    with pytest.raises(SystemExit) as exit_:
        main([flag, value, "--model-args", f"pretrained={tmp_path}/missing", "--output", str(tmp_path / "out")])
    assert exit_.value.code == 2 and named in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_approximations_and_their_arguments_reach_the_sweep():
    from alspec_eval.niah.cli import niah_config, parser

    config = niah_config(parser().parse_args(["--approx", "sink,quest,snapkv", "--approx_args", "quest=page:16",
                                              "--approx_args", "snapkv=recent:4;observe:16"]))
    assert [a.label for a in config.approx] == ["sink", "quest P=16", "snapkv W=16 k=5 R=4"]
