"""Entry points: the `fdx` command line (cli.py, engine_args.py), the
OpenAI-compatible server, its engine process and the router (serving/), and
the benchmarks (bench/). They import the engine (fdx.core) and model I/O
(fdx.model_io); neither imports them."""
