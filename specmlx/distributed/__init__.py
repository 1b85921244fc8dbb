"""Ranks: the world, the per-round lockstep and shared k, and launching under mlx.launch."""
