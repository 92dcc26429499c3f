"""The OpenAI-compatible HTTP server: the app and its routes, request and response bodies,
one serving module per endpoint family, tools, reasoning, metrics and run-batch."""
