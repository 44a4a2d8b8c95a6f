"""The Loader end to end, in one process and under torchrun."""
