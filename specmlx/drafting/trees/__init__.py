"""Token trees: how wide a round's tree is, EAGLE-2's grown trees, the row drafters that propose trees."""
