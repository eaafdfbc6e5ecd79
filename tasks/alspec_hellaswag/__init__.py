"""lm-eval task configs: alspec_hellaswag (YAML and data; utils.py is loaded by lm-eval by path)."""
