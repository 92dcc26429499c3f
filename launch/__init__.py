"""Command line, process start-up and supervision."""
