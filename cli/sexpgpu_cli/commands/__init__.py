"""Built-in subcommands, one module each, imported only when invoked or listed."""

BUILTIN_COMMANDS = {
    "run": "sexpgpu_cli.commands.run:run",
    "check": "sexpgpu_cli.commands.check:check",
    "compile": "sexpgpu_cli.commands.check:compile_",
    "checkpoint": "sexpgpu_cli.commands.checkpoint:checkpoint",
    "plugins": "sexpgpu_cli.commands.plugins:plugins",
}
"""name -> ``module:attribute``; imported only when the command runs or ``--help`` lists it.
A plugin never replaces one of these."""
