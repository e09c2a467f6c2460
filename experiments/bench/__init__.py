"""Benchmarks that train models: ``gradcomp bench ddp`` (:mod:`~gradcomp.experiments.bench.ddp`)."""
