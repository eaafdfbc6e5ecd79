"""The one error type of a bad setting (config.py re-exports it; schedule.py needs it without config.py)."""


class ConfigError(ValueError):
    """A bad `--model_args` value; the message names the value and the fix."""
