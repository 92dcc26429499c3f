"""GPU/CPU worker process: persistent batch, block tables, model runner (later issues)."""
