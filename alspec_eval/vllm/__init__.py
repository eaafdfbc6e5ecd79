"""ALSpec inside vLLM (``lm_eval --model alspec-vllm``): the same rules (:mod:`alspec_eval.semantics`) verified inside
vLLM's attention, over its paged KV cache.

- :mod:`.paged`: the tokens of a step that speculate, the cache layouts, A~ and the decision (torch only);
- :mod:`.backend`: the attention backend that wraps the platform's own (A) and calls :mod:`.paged`;
- :mod:`.plugin`: the ``vllm.general_plugins`` entry point that installs it in every vLLM process of an alspec-vllm
  engine, and in no other;
- :mod:`.worker`: the worker extension the driver configures and reads the decisions back through;
- :mod:`.model`: the lm-eval model, a subclass of lm-eval's ``VLLM``.
"""
