"""The command line, the benches, the soak and the testing helpers."""
