"""The project's own tools, beside the library: the benchmarks (``bench`` and
its ``bench_*`` sections, ``python -m centralpipe bench``) and the soak
(``soak``, ``python -m centralpipe soak``). The library never imports them
(a test checks it); only ``centralpipe.__main__`` does."""
