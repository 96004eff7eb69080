"""Examples of adapters for `--impl` (README, "Plugging in your own system")."""
