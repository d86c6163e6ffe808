"""The engine: ``arguments`` declares every argument of both front ends once (``DDPPlusArguments``: type, default,
docstring, check); ``DDPPlusEngine`` owns one DDP run and one component per concern and applies their decisions in
order; ``setup_line`` is the line rank 0 logs at setup.

May import: every package but ``frontends``.
"""
