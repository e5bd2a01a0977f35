"""The `llmfleet` command (`main`), the fleet launcher and supervisor (`launcher`), and
`llmfleet bench serve` (`benchserve`)."""
