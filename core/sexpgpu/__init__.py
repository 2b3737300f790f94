"""sexpgpu: train neural networks described in `.sx` files, and never lose a run.

The core package holds the language, the plugin machinery, the run loop and the
checkpoint layer. It never imports a plugin: lowerings, kernels, optimizers,
storage backends, metrics sinks, data sources and extra CLI commands arrive
through the entry-point group ``sexpgpu`` (see :mod:`sexpgpu.hookspecs`).
"""

__version__ = "0.1.0"
