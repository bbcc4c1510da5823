"""The C helpers' build: they use the numpy C API, whose headers' folder only numpy can name, so they are declared
here rather than in pyproject.toml (which holds everything else)."""

import numpy
from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "hyper_parallel.data.indexed._indexed_helpers",
            sources=["hyper_parallel/data/indexed/csrc/indexed_helpers.c"],
            include_dirs=[numpy.get_include()],
            extra_compile_args=["-O2", "-ffp-contract=off"],
        ),
        Extension(
            "hyper_parallel.data.parallel.scheduling._placement",
            sources=["hyper_parallel/data/parallel/scheduling/csrc/placement.c"],
            include_dirs=[numpy.get_include()],
            extra_compile_args=["-O2", "-ffp-contract=off"],
        ),
    ]
)
