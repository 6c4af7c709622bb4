"""Prove it: `make test` and `make test-releases`, the differential and
liveness oracles, soak, bench, mutate, and the real server (`make e2e`).

Imports `lib` and `keep` (the trees it proves are built by `keep.apply`).
"""
