"""`opsadv bench`: speed against peers, measured side by side on one GPU (see docs/performance.md)."""
