"""Benchmarks behind ``gradcomp bench``: compressor kernels today; collectives and DDP steps next."""
