"""Hybrid draft tree, tree verification (exact and epsilon-threshold), the verifier-to-phone hand-off, and end-to-end metrics."""
