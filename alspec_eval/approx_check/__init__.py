"""``alspec-check-approx``: the contract any approximation of A must keep, checked on tiny random models of three
families (llama, qwen2, gemma2), one line per broken property (docs/design.md, Approximations)."""
