"""The memory plan: per-rank bytes of a DDP run before it starts, and which strategy fits the device.

``sizes``: byte sizes as people write them (``80GiB``); ``measure``: what one model, optimizer and training batch
take (parameters, gradients, DDP's buckets, optimizer state, activations counted with saved-tensor hooks);
``devices``: how the job's device runs the step where it differs from the CPU measuring it (CUDA's foreach
optimizer step, its allocator's blocks);
``plan``: those figures per layout (plain DDP, ``gradient_as_bucket_view``, optimizer sharding at a world size,
activation checkpointing) against the device's memory; ``decisions``: the decision table, as data; ``suggestion``:
the chunk size ``ddp-plus check`` leaves for ``chunk_size="auto"`` to start from.

May import: ``config``, ``sharding``, ``private_apis``.
"""
