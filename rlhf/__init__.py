"""RLHF stages on top of the trainer: SFT, reward model, PPO, DPO and GRPO (losses, verifiable tasks)."""
