"""Programs the tests run by path (torchrun ranks, orphan and service mains, probes)."""
