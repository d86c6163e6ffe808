"""Front ends: the Trainer strategy, the Fabric strategy, the Hugging Face port and the ``ddp-plus`` command line,
each a thin layer of overrides that adapt their framework and delegate to the engine. ``common`` is what both
strategies share, ``registry`` the names they are registered under, ``cli_arguments`` how the command line's
strategy arguments are read back to explain a refusal.

May import: every package. Nothing imports it but the package's ``__init__`` and ``__main__``.
"""
