"""The OpenAI-compatible HTTP front (`infersim serve --http`): routes, request and response bodies, incremental
detokenization, Prometheus metrics."""
