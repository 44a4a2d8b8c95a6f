"""The central stages: sources, readers, regrouping, totals."""
