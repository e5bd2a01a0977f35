"""The `llmfleet` command: `main` (entry point and exit status), `parser` (its arguments),
`generate` (`generate` and `chat`), `printer` (completion output), `up` (`llmfleet up`),
`fleet_plan` (a fleet's children, flags and ports), `launcher` (starting, watching and stopping
them), and `llmfleet bench serve` (`benchserve`)."""
