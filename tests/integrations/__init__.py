"""Lightning and the progress bar."""
