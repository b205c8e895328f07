"""One module per `mlx_spec` subcommand: add_arguments(parser) and run(args) -> int."""
