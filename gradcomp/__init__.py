"""gradcomp: gradient compression and communication optimization for PyTorch data parallelism.

The core library (no DDP knowledge): compressors and error feedback today; the all-reduce engine,
collectives, cost model and benchmarks build on them. DDP communication hooks live in ``hooks``.
"""

from gradcomp.compressors import REGISTRY, Aggregation, Compressor, make_compressor, parse_spec
from gradcomp.feedback import ErrorFeedback

__version__ = "0.1.0"

__all__ = ["REGISTRY", "Aggregation", "Compressor", "ErrorFeedback", "__version__", "make_compressor", "parse_spec"]
