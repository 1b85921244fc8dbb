"""The primitives a round is made of: sampling and acceptance math, caches and their rollback, a cursor per model, the hidden-state tap, stats."""
