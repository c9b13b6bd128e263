"""OpenAI-compatible HTTP server (FastAPI + uvicorn) around one engine thread."""
from drafttree.server.app import create_app, run_server

__all__ = ["create_app", "run_server"]
