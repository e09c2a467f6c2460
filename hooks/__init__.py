"""DDP communication hooks: thin adapters from DDP's ``GradBucket`` to gradcomp's engine.

This package depends on ``gradcomp``; nothing in ``gradcomp`` imports it. Its public entry points
arrive with the engine (see ``docs/architecture.md``), and take the same compressor specs as
:func:`gradcomp.make_compressor`::

    import hooks
    state, hook = hooks.make("topk:ratio=0.01,ef=true")
    ddp_model.register_comm_hook(state, hook)
    state = hooks.register(ddp_model, "powersgd:rank=4")   # the same, in one line

``make(spec)`` returns a checkpointable state (``state_dict`` / ``load_state_dict``) and the hook;
``register(model, spec)`` does both and returns the state. Until the engine lands, the package
exports nothing, so that no caller can mistake a placeholder for a working hook.
"""

__all__: list[str] = []
