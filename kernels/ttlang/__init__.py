"""TT-Lang speculative flash decode; needs the `ttl` package (the compiler or tt-lang-sim).

``decode.ttlang_decode`` runs one decode step through the kernel (``spec_decode``); ``decode.load_ttnn`` picks
the simulator or the device. Nothing is imported here so that ``alspec_eval.kernels`` works without it.
"""
