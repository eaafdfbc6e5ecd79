"""lm-eval task configs: alspec_table1 (YAML and data; utils.py is loaded by lm-eval by path)."""
