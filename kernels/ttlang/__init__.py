"""TT-Lang speculative flash decode; needs the `ttl` package (the compiler or tt-lang-sim).

Nothing is imported here so that ``alspec_eval.kernels`` works without it.
"""
