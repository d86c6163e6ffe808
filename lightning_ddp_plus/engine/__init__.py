"""The engine: ``arguments`` declares every argument of both front ends once (``DDPPlusArguments``: type, default,
docstring, check); ``components`` builds one component per concern from them (``EngineComponents``, with what a front
end reads of them); ``engine`` (``DDPPlusEngine``) holds them in one ordered list, the step pipeline, and walks a
training step through it; ``setup_line`` is the line rank 0 logs at setup.

May import: every package but ``frontends``.
"""
