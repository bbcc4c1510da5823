"""hyper_parallel: parallel training components. This distribution ships the ``data`` package."""
