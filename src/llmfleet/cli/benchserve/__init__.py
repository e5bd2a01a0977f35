"""`llmfleet bench serve`: a serving benchmark against the gRPC API or an OpenAI endpoint.

Modules, one concept each: `datasets` (prompts), `arrival` (when requests arrive), `backends`
(send one request and time its stream), `stats` (records and aggregates), `report` (text and
JSON), `plots` (PNG timeline and latency distributions), `runner` (the whole run), `args`
(command-line arguments). All but `backends` and `runner` are plain Python without network.
"""
