"""lm-eval task and group configs of alspec-eval, installed as `alspec_eval.tasks` and found without --include_path."""
