"""Drafts copied from text already seen: prompt lookup with memory, suffix lookup, Lookahead's n-grams."""
