"""The OpenAI-compatible HTTP gateway: `/v1/chat/completions`, `/v1/completions`, `/v1/models`
in front of the router's gRPC `Generation` API (app.py), started as
`python -m llmfleet.services.gateway`."""
