"""The single-machine trainer: SFT warm start, PPO with TIR-OTB advantages, configuration."""
