"""Bundled data: the needle-in-a-haystack text (public domain) and the ALSpec paper's Tables 1 and 2 (scores and
hit rates per task and lambda, from Cai et al., ICML 2025) for the report's comparison with the paper."""
