"""Backends compute the speculative attention; `sim` simulates it in torch, `tt` runs it through ttnn."""
