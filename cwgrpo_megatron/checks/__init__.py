"""Self-checks: the layout check and its verdict, the weight-sync check, measured memory, and
the fixtures they run on (tiny random models, channel permutations, truncated checkpoints)."""
