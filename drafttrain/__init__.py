"""drafttrain: keep speculative-decoding drafters fresh during RL post-training."""
