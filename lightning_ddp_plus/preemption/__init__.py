"""Preemption: a termination notice (SIGTERM, SLURM's ``--signal``) on any rank stops every rank after the same
optimizer step, which is saved; the fit then ends with ``Preempted``.

May import: config, sync, pipeline, private_apis.
"""
