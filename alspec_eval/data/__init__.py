"""Bundled data: the needle-in-a-haystack text (public domain)."""
