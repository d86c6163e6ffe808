"""The conflict check and its per-step guard: facts observed on the model's first training forward, the rules
(frozen data evaluated by one pure function), the check that applies them and agrees across ranks, the guard on
every synced backward, and ``DDPConflictError``.

May import: ``config``.
"""
