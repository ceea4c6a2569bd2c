"""Model I/O: GGUF and Hugging Face checkpoints, the tokenizer and chat template."""
