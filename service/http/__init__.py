"""HTTP transport: the server (uvicorn on the shared loop), the call middleware, error rendering, the app."""
