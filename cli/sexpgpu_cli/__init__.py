"""The ``sexpgpu`` command line (click)."""
