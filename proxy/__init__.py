"""phasewatch: an instrumenting reverse proxy for self-hosted LLM engines."""

__version__ = "0.1.0"
