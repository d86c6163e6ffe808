"""Checkpoints that survive the fault: atomic writes on the checkpoint's own filesystem, which file a resume may use
(checked without unpickling), and the resume decided once for all ranks and loaded weights-only.

May import: ``config``, ``processes``.
"""
