"""Processes and restarts: launchers that end a job cleanly, the process group of each torchrun attempt and the
attempt the ranks agree on, and who is reachable after a failed collective.

May import: ``config``, ``private_apis``.
"""
