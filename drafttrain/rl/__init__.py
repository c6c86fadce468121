"""RL-side integration: DraftTracker hooks, the embedded GRPO host, the TRL callback."""
