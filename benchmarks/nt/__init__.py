"""neural-tangents as an optional benchmark peer (its own venv; see client.py)."""
