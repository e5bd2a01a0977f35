"""Text around the token ids: chat-template rendering, tokenizer loading, incremental
detokenization with stop strings. Used by the tokenizer service and the in-process `LLM`."""
