"""Lambda sweeps: every (task, policy, lambda) cell of the paper's Table 1, resumable."""
