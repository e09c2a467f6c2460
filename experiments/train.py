"""Train a model with DDP and a gradcomp communication hook (the training run's command).

    torchrun --nproc-per-node 2 experiments/train.py --task digits --hook topk:ratio=0.01,ef=true --out runs/topk
    python -m gradcomp.experiments.train --ranks 2 --network 1gbit --task digits --hook fp16 --steps 400

The run itself lives in :mod:`gradcomp.experiments.training` (``run.py``: the command, the ranks,
the run; ``--help`` lists every option). See ``docs/experiments.md``.
"""

import sys

from gradcomp.experiments.training.run import main

if __name__ == "__main__":
    sys.exit(main())
