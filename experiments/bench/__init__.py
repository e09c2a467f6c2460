"""Benchmarks that train models: ``gradcomp bench ddp`` (:mod:`~gradcomp.experiments.bench.ddp`),
``gradcomp bench fsdp`` (:mod:`~gradcomp.experiments.bench.fsdp`) and ``gradcomp bench predict``
(:mod:`~gradcomp.experiments.bench.predict`).

``ddp`` and ``fsdp`` are one benchmark in two modes, in modules of one job each: ``settings``
(:class:`~gradcomp.experiments.bench.settings.BenchSettings`, what one measurement is), ``modes``
(DDP's replicas or FSDP2's shards), ``workloads`` (the presets, and a user's model imported),
``ranks`` (what every rank runs and times), ``records`` (what it reads of the hooks' per-step
records), ``runner`` (ranks started per run, failures), ``results`` (rows, runs merged), ``table``
(Markdown) and ``command`` (the command line both share).
"""
