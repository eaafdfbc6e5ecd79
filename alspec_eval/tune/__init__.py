"""alspec-tune: the per-layer lambda schedule with the largest projected speedup within a score budget."""
