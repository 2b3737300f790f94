"""``python -m sexpgpu_cli``: the ``sexpgpu`` command, for launchers that start a module.

``torchrun --nnodes 2 --nproc-per-node 4 ... -m sexpgpu_cli run FILE`` runs one
worker per device this way; ``sexpgpu run --devices N`` starts its workers so too.
"""

from sexpgpu_cli.console import main  # first: it takes the signals

if __name__ == "__main__":
    main()
