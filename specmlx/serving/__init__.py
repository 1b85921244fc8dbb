"""The HTTP server: OpenAI and editor endpoints, the generation worker, the prompt cache, the client."""
