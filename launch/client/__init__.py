"""The engine client: engine arguments and process start-up, `LLM` and `AsyncLLM`, input and
output processing (tokenizer, chat templates, detokenizing, stop strings), beam search."""
