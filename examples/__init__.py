"""Runnable examples for lightning-ddp-plus; importable as ``examples.*`` from the repository root."""
