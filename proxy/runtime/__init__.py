"""Running the proxy: uvicorn with a graceful drain, N workers, log lines."""
