"""Front ends: the Trainer strategy, the Fabric strategy, the Hugging Face port and the ``ddp-plus`` command line,
each a thin layer of overrides that delegate to the engine.

May import: every package. Nothing imports it but the package's ``__init__`` and ``__main__``.
"""
