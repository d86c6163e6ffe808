"""Optimizer-state sharding (ZeRO stage 1): each rank keeps the optimizer state of a share of the parameters.

``partition``: torch's sorted-greedy assignment of whole parameters to ranks, as plain arithmetic (the memory plan
uses it); ``optimizer``: wrapping an optimizer in ``ZeroRedundancyOptimizer`` with its class, hyperparameters and
parameter groups, what each mode refuses and why, and the overlap hook.

May import: ``config``, ``private_apis``.
"""
