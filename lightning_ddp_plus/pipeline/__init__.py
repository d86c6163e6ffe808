"""The step pipeline's protocol: ``StepComponent``, the small published base class of every per-step feature (the
conflict check, the step guard, the accumulation window, ...), the records a component is handed at each point of
a fit (``FitStart``, ``ForwardStart``, ``BackwardStart``, ``BackwardEnd``, ``EpochEnd``), ``StepPipeline``, which
calls an ordered list of components in order, and the per-step agreement's named flags (``agreement``).

The engine holds the list and its order; each feature's module subclasses ``StepComponent`` where it lives.

May import: nothing of the package (torch and the standard library).
"""
