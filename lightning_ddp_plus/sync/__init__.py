"""Synchronization: how gradients are all-reduced and how the ranks stay in step. Accumulation windows (one
all-reduce per optimizer step), bucket sizes, communication hooks, uneven inputs, building the DDP wrapper
(``wrapper``), the per-step guard that every synced backward all-reduced every bucket (``step_guard``) and the small
gloo group it and uneven inputs agree on (``side_channel``). DDP's private API is reached through ``private_apis``.

May import: ``config``, ``pipeline``, ``private_apis``.
"""
