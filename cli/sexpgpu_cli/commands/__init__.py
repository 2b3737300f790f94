"""Built-in subcommands, one module each, imported only when invoked or listed."""
