"""The tokenizer service: chat rendering, tokenization and incremental detokenization over gRPC
(the text logic itself is in `llmfleet.text`)."""
