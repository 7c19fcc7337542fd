"""tui: the Textual terminal app over agent_runtime's public API."""
