"""Constants that the rules (semantics.py), the settings (config.py) and the approximations share: a leaf module
(it imports nothing of the package), so none of them imports another for a number."""

TILE = 32  # a Tenstorrent tile; window_align=32 mirrors the TT op (the rules themselves: semantics.py)
WINDOW_ALIGNS: tuple[int, ...] = (1, TILE)
