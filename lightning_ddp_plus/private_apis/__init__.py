"""The private names of torch and Lightning that the package uses, in one room.

Every underscored name of torch or Lightning the package imports or reads (a private module, class or function, an
underscored attribute of their objects) is reached through a function or a name of this subpackage, never
directly: ``tests/test_layout.py`` walks the package's syntax trees and fails on any other. Each module's table says
what each name is for, the releases it was checked on and what happens where it is missing (a probe that turns the
feature off with a message, or a clear error). When torch or Lightning moves, this is where the package breaks, and
the tables say what breaks with it.

- ``torch_ddp``: ``DistributedDataParallel`` and its reducer (rebuilding it, completing a backward, timings);
- ``torch_distributed``: the job's store and default group, group timeouts, the autograd engine's callbacks,
  pytrees, dispatch modes, foreach kernels, ``ZeroRedundancyOptimizer``;
- ``torch_rendezvous``: torchrun's rendezvous handler (imported by torchrun's agent only);
- ``lightning``: Lightning's launchers, checkpoint loading and connector, the async checkpoint IO's wrapper,
  Fabric's backward-sync control and backward flag, and the fit loop's loaders.

A front end may still override and read the protected members of the Lightning strategy it subclasses
(``_configure_launcher``, ``self._launcher``, ...): that is Lightning's extension API for strategies.

May import: torch, Lightning and the standard library only; nothing else of this package.
"""
