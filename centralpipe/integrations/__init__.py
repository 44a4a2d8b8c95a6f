"""The library beside other tools: PyTorch Lightning (``lightning``, public as
``centralpipe.lightning``, an optional extra) and a tqdm progress bar
(``progress``, public as the function ``centralpipe.progress``)."""
