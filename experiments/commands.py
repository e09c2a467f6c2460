"""What ``gradcomp --help`` says of this layer's commands, read without importing them (it imports no
torch): the entry point ``gradcomp.summaries`` names this table, and each command's own parser says
the same (``tests/test_packaging.py`` checks that they agree)."""

SUMMARIES = {
    "gradcomp.commands": {
        "explain": "print what a hook spec does with each bucket of a model, and why",
        "plan": "predict every compressor and algorithm on a cluster; recommend one",
        "report": "an HTML page comparing a sweep's runs by time to accuracy",
        "sweep": "run a grid of trainings from a TOML config",
    },
    "gradcomp.bench": {
        "ddp": "DDP step time: gradcomp hooks beside torch's, per network",
        "fsdp": "FSDP2 step time: gradcomp's reduce-scatter beside FSDP2's own, per network",
        "hsdp": "HSDP step time: gradcomp's all-reduce across nodes beside FSDP2's own HSDP",
        "predict": "the cost model's step times against measured ones",
    },
}
"""Entry-point group -> command -> its one-line help."""
