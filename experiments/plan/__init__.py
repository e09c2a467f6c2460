"""``gradcomp plan``: predicted step times of every compressor and algorithm on a cluster you describe
(:mod:`gradcomp.cost.plan`), as text, JSON, and an HTML page with scaling curves."""
