"""ALSpec inside vLLM (``lm_eval --model alspec-vllm``): the same rules (:mod:`alspec_eval.semantics`) verified inside
vLLM's attention, over its paged KV cache.

- :mod:`.paged`: the tokens of a step that speculate, the cache layouts, A~ and the decision (torch only);
- :mod:`.backend`: the speculating impl, after the platform's own (A), that calls :mod:`.paged`;
- :mod:`.backends`: each vLLM backend it wraps, as an ordinary subclass with that impl;
- :mod:`.plugin`: the ``vllm.general_plugins`` entry point that registers them (vLLM's ``register_backend``) in every
  vLLM process of an alspec-vllm engine, and in no other;
- :mod:`.worker`: the worker extension the driver configures and reads the decisions back through;
- :mod:`.model`: the lm-eval model, a subclass of lm-eval's ``VLLM``.
"""
