"""The HTTP server: the OpenAI-compatible app, its request models and metrics."""

KEEP_ALIVE_SECONDS = 30.0
"""How long the server keeps an idle keep-alive connection open. It must outlast the 5 s after which httpx (so also
the openai client) stops reusing an idle connection: at equal timeouts the server can close a connection just as the
client sends its next request on it, and that request fails with a connection reset (httpx.ReadError)."""
