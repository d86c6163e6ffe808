"""The main job, shipped with the package so that it runs where the repository was never cloned: the spiral
classification task (``spirals.py``) and its config (``cpu.yaml``, also the repository's ``configs/cpu.yaml``).

``ddp-plus demo`` trains it on 2 CPU processes; ``ddp-plus demo --write-config FILE`` writes the config to edit.

May import: nothing of the package.
"""

from pathlib import Path

from lightning_ddp_plus.demo.spirals import SpiralClassifier, SpiralDataModule, make_spirals

#: The main job's config: 2 processes on CPU with gloo, every strategy argument written out.
DEMO_CONFIG = Path(__file__).with_name("cpu.yaml")

__all__ = ["DEMO_CONFIG", "SpiralClassifier", "SpiralDataModule", "make_spirals"]
