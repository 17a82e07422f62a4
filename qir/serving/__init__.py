"""Serving many requests at once: the engine (requests in, deltas out; qir.serving.engine) and
the OpenAI-compatible HTTP server in front of it."""

from qir.serving.engine import Delta, Engine, EngineClosed, QueueFull, Request, Stream

__all__ = ["Delta", "Engine", "EngineClosed", "QueueFull", "Request", "Stream"]
