"""Processes and restarts: launchers that end a job cleanly, the process group of each torchrun attempt,
mid-epoch resume of the data, and who is reachable after a failed collective.

May import: ``config``.
"""
