"""Client-side latency benchmark for any OpenAI-compatible server (a pure HTTP client:
nothing here imports vivace's engine, server or torch)."""
