"""gradcomp: gradient compression and communication optimization for PyTorch data parallelism.

One import name, in layers whose dependencies point one way (``docs/architecture.md``):

- the core: ``gradcomp.compressors`` (and error feedback), ``gradcomp.collectives``,
  ``gradcomp.engine`` (the per-bucket pipeline), emulated networks, launching and benchmarks;
- ``gradcomp.hooks``: DDP communication hooks over the engine;
- ``gradcomp.experiments``: training runs, sweeps and the DDP benchmark (``pip install
  'gradcomp[experiments]'`` for what they need beyond the core).
"""

from gradcomp.compressors import REGISTRY, Aggregation, Compressor, make_compressor, parse_spec
from gradcomp.compressors.feedback import ErrorFeedback

__version__ = "0.1.0"

__all__ = ["REGISTRY", "Aggregation", "Compressor", "ErrorFeedback", "__version__", "make_compressor", "parse_spec"]
