"""learner: GRPO and online RL from recorded sessions (imports agent_runtime, never tui)."""
