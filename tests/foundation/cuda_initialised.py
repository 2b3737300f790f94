"""Imported by a test's preloader after torch: torch then says CUDA is initialised, as
an import of torch's compiler can make it on a GPU machine (test_preloaded.py)."""

import torch

torch.cuda.is_initialized = lambda: True
