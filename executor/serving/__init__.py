"""The ways the engine serves a plan: the timed replay (serve.py), the online loop behind the HTTP server
(online.py), disaggregated prefill and decode instances (disaggregated.py, kv_transfer.py)."""
