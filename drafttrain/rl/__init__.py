"""RL-side integration: the main job, the embedded GRPO host, the TRL callback (the hooks: `from drafttrain import
DraftTracker`)."""
