"""Replica choice: token-id prefix trees, routing policies, and the Ray Serve request-router glue.
Plain Python except request_router.py."""
