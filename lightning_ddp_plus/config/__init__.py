"""Configuration vocabulary: the DDP settings (``DDPSettings``), backends, timeouts, the Hugging Face names
(``training_arguments``) and the wording of errors about bad values.

May import: ``pipeline``, ``private_apis`` (and torch, Lightning and the standard library).
"""
