"""lm-eval task configs: alspec_recall (YAML and data; utils.py is loaded by lm-eval by path)."""
