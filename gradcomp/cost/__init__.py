"""The cost model: what a data-parallel step costs on a cluster, and which compressor pays.

- :mod:`~gradcomp.cost.cluster`: collectives on nodes of ranks (intra- and inter-node links).
- :mod:`~gradcomp.cost.kernels`: compressors' kernel costs, timed and interpolated.
- :mod:`~gradcomp.cost.profile`: calibration profiles (fitted links, kernels) as JSON.
- :mod:`~gradcomp.cost.calibrate`: ``gradcomp calibrate``: measure and fit on this machine.
- :mod:`~gradcomp.cost.compute`: a model's forward, backward (when each gradient is ready), optimizer.
- :mod:`~gradcomp.cost.step`: one DDP step predicted: buckets, overlap, the tail.
- :mod:`~gradcomp.cost.plan`: every compressor and route on a cluster, a recommendation, scaling.
"""
