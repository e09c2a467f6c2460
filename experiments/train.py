"""Train a model with DDP and a gradcomp communication hook (the training run's command).

    torchrun --nproc-per-node 2 experiments/train.py --task digits --hook topk:ratio=0.01,ef=true --out runs/topk
    python -m gradcomp.experiments.train --ranks 2 --network 1gbit --task digits --hook fp16 --steps 400

The run itself lives in :mod:`gradcomp.experiments.training` (``run.py``: the command, the ranks,
the run; ``--help`` lists every option). See ``docs/experiments.md``.
"""

import os
import sys

from gradcomp.experiments.training.run import main

if __name__ == "__main__":
    code = main()
    # Leave without the interpreter's teardown: with torch 2.13's gloo, a process that held process
    # groups sometimes aborts there ("terminate called without an active exception", plain DDP too),
    # after the run has finished and been recorded; torchrun would report that as a failure.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
