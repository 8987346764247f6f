"""Work models of the fused kernels, one module per family: what a launch config costs
(``cost.Work`` per config, scored by ``cost.estimate``) and what the op's eager body
costs (``cost.eager_time``).

Configs are spelled in the Triton launchers' names (``block_t``, ``num_warps``, ...);
another backend's tuning space maps its own names onto them. A model that needs a
launcher's rule (a split or grid heuristic, a warp count) takes it as an argument, so
this package imports only the tuner core, never a backend.
"""
