"""The conflict check: facts observed on the model's first training forward, the rules (frozen data evaluated by one
pure function, named by ``RuleId``), the check that applies them and agrees across ranks, every rule decision (R1-R7:
at the first backward, and R6 when the per-step guard in ``sync`` finds a fault later), and ``DDPConflictError``.

May import: ``config``, ``pipeline``, ``private_apis``.
"""
