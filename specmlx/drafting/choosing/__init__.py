"""How much to draft: adaptive k, the choosers and their store, the pass-cost curve and its probe."""
