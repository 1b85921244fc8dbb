"""The built-in prompt sets (package data)."""
