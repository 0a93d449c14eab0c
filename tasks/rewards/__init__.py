"""Reward functions shipped with rlflow. Each has TRL's signature: f(completions, **columns) -> list[float|None]."""
