"""The round loop (engine), the one place a request becomes a generation (session), token events to text (stream, FIM)."""
