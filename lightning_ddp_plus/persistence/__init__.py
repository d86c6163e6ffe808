"""Checkpoints that survive the fault: atomic writes on the checkpoint's own filesystem (the checkpoint IO you pass
stays yours), which file a resume may use (checked without unpickling), and ``resume.ResumeCoordinator``: the resume
decided once for all ranks, loaded weights-only, and the rest of an interrupted epoch's data.

May import: ``config``, ``processes``, ``private_apis``.
"""
