"""An OpenAI-compatible HTTP server on the Engine (``flexpage serve``; ``pip install flexpage[serve]``).

``protocol`` holds the request bodies, ``runner`` the thread that owns and steps the Engine,
``app`` the FastAPI handlers, ``metrics`` the Prometheus metrics, ``cli`` the command.
"""

from .app import build_app

__all__ = ["build_app"]
