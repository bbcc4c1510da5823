"""Side-by-side benchmarks of ``hyper_parallel.data`` against reference implementations.

Run ``python -m benchmarks`` from the repository root; see ``benchmarks/README.md``.
"""
