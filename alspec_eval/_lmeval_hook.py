"""Registers `--model alspec` with lm-eval's model registry; imported by a `.pth` line at startup.

lm-eval 0.4.13 reads no entry points for models, so this hook registers a lazy
`module:Class` placeholder. It must stay cheap (no torch import) and silent when
lm-eval is absent. `lm_eval.models` is imported first: `get_model` only fills the
registry with the built-in names while it is empty, so registering into an empty
registry would hide `--model hf`.
"""

try:
    import lm_eval.models  # noqa: F401  (registers the built-in names first)
    from lm_eval.api.registry import model_registry
except Exception:  # lm-eval missing or broken: nothing to register into
    pass
else:
    if "alspec" not in model_registry:
        model_registry.register("alspec", target="alspec_eval.adapter:ALSpecLM")
