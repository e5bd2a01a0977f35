"""The router: the public `llmfleet.v1.Generation` API, worker registry, routing and
prefill→decode orchestration (see docs/fleet.md)."""
