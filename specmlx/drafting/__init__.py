"""What proposes drafts (a draft model, prompt lookup, MTP heads) and how many (adaptive k and its choosers)."""
