"""Optimizer-state sharding (ZeRO stage 1): each rank keeps the optimizer state of 1/N of the model.

``zero``: the mode as a run applies it (the hook, the optimizers, clipping); ``bucket_shards``: each rank's chunk of
every gradient bucket, as arithmetic; ``reduce_scatter``: the hook of ``optimizer_sharding=True``; ``sharded_step``:
the step on a rank's chunks and the all-gather; ``exchange``: reduce-scatter and all-gather as pairwise exchanges, for gloo;
``optimizer``: the modes and what each refuses; ``zero_redundancy``: torch's ``ZeroRedundancyOptimizer`` for
``"all_reduce"`` and ``"overlap"`` (imported only there: it costs 0.2 s); ``partition``: torch's sorted-greedy
assignment of whole parameters to ranks, as arithmetic.

May import: ``config``, ``pipeline``, ``private_apis``.
"""
