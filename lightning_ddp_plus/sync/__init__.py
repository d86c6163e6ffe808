"""Synchronization: how gradients are all-reduced. Accumulation windows (one all-reduce per optimizer step),
bucket sizes, communication hooks, uneven inputs, and building the DDP wrapper and rebuilding its reducer (the only
code that touches DDP internals).

May import: ``config``.
"""
