"""The dispatch boundary: executors, workers, the wire, faults, signals, central modes."""
