#!/usr/bin/env bash
# The README's main job: a small lambda sweep and a needle run on the embedded SmolLM2-135M, on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
.venv/bin/alspec-sweep configs/demo.yaml
.venv/bin/alspec-niah --lengths 2048 --depths 0.1,0.5,0.7 --lambdas 0.05,0.1,0.2 --window 64 --max-gen-toks 12 \
    --output results/niah_demo
echo
echo "Table 1 and figures: results/demo/report/report.html (table1.md, *.png)"
echo "Needle figures:      results/niah_demo/figures/"
