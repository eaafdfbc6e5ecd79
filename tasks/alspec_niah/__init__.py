"""lm-eval task configs: alspec_niah (YAML and data; utils.py is loaded by lm-eval by path)."""
