"""Heads that draft from the target's own hidden states (MTP, EAGLE-3, DFlash, Medusa) and the files they ship as."""
