"""A local server for editors and coding agents (FastAPI on uvicorn).

FastAPI is the Python ecosystem's standard for typed HTTP APIs: request validation, an OpenAPI
schema (``/openapi.json``, what fuzzers and SDK generators read) and SSE streaming over ASGI.

``engine`` runs generations (one at a time, in a worker thread that owns the prompt caches);
each protocol is a module of routes over it (``openai``); ``app`` puts them together with what
every protocol shares: authentication, body limits, health and metrics, and runs it (``serve``).
"""

from .app import create_app, serve
from .engine import Engine, model_context_length

__all__ = ["create_app", "serve", "Engine", "model_context_length"]
