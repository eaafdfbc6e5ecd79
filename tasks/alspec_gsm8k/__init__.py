"""lm-eval task configs: alspec_gsm8k (YAML and data; utils.py is loaded by lm-eval by path)."""
