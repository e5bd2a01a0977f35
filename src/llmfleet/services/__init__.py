"""The fleet's services, each a gRPC (or HTTP) server plus its role logic: gateway, router,
tokenizer, worker, kvstore. None imports another; they meet only on the wire."""
