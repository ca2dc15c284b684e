"""The ``opsched`` command: demo, bench, stress, trace, products, plots.

The library never imports this package; it uses the library's public faces (and the
operator descriptions, for the stress harness and benchmarks).
"""
