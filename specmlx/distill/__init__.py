"""Training a draft model on the target's outputs."""
