"""The engine: ``DDPPlusEngine`` owns one DDP run and one component per concern; ``options`` validates every
argument both front ends take.

May import: every package but ``frontends``.
"""
